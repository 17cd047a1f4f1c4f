"""Context parallelism over `cp`: the sequence split over devices, attention spanning the split.

Read in this order:
    zigzag.py          the layout (device i holds chunks i and 2cp-1-i of 2cp) and the chunk pairs it leaves
    online_softmax.py  one (query chunk, key chunk) pair folded into a running softmax, and its backward
    ring.py            `context.strategy=ring`: K/V blocks around a ring with `ppermute`, a second ring backward
    all_gather.py      `context.strategy=all_gather`: K/V gathered once, dK/dV reduce-scattered home
    ulysses.py         `context.strategy=ulysses`: all-to-all to a head split around the backend's attention
    strategy.py        `context_attention` / `validate_strategy`: the strategy a run asks for
"""
