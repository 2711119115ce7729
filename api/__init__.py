"""kvpilot.api: the InferenceModel API (kvpilot.dev/v1alpha1) that the operator, the autoscaler and the
router share.

`models` holds the pydantic models of spec and the whole status, the group/version/kind/plural, the
labels and the defaults; `crd` generates the CustomResourceDefinition from them (`kvpilot crds`).
Nothing here talks to a cluster (that is `kvpilot.kube`), and no part imports another part for these.
"""

if __name__ == "api":  # the checkout's root is on sys.path: see kvpilot/source_tree.py
    from kvpilot.source_tree import defer_to_installed

    defer_to_installed(__name__, __file__)
