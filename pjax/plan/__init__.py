"""The layout planner (`python -m pjax.plan`): which dp/pp/cp/tp, ZeRO stage, remat and micro-batch
count fit a config on N devices, and which is fastest.

    layouts.py   the search space, and the exact training state per device
    profiles.py  device kinds: peak, memory, links, and the efficiency measured on them
    estimate.py  the roofline: compute, pipeline bubble, collectives per mesh axis
    pipeline_cost.py, stream_cost.py  the bubble's table ratio and what a pipeline's ticks and tp's repeated
                 residual stream cost, measured on the model at hand (`calibrate`)
    compile.py   ahead-of-time compiles on fake CPU devices (pool, cache) and XLA's figures
    search.py    score everything, compile the best, rank by XLA's figures
    report.py    the table, the verdict and the JSON
    inspect.py   a step's shardings, memory, collectives and matmuls (`log.inspect=true`)
    explain.py   one layout in detail (`--explain`): inspect's tables, the prediction and its breakdown
"""
