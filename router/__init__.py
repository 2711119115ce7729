"""The fleet router: one OpenAI endpoint in front of many models' pods (`kvpilot router`).

`policy` holds the pure routing decisions (usable without aiohttp, e.g. from the fleet simulator),
`keys` turns a request body into its routing key, `pool` keeps a model's pods and its central queue,
`server` is the aiohttp shell (`Router`), which sends requests to pods through `upstream`, watches
their health with `health` and judges the SLO with `judge`; `discovery` feeds the pools from a static
list or Kubernetes (`source` is the protocol it follows). A disaggregated model's prompts run on its
prefill pods first: `pd` decides (pure), `prefill` runs that leg.
"""

if __name__ == "router":  # the checkout's root is on sys.path: see kvpilot/source_tree.py
    from kvpilot.source_tree import defer_to_installed

    defer_to_installed(__name__, __file__)
