if __name__ == "kernels":  # the checkout's root is on sys.path: see kvpilot/source_tree.py
    from kvpilot.source_tree import defer_to_installed

    defer_to_installed(__name__, __file__)
