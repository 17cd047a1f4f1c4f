"""Pipeline parallelism over `pp`: any schedule, as a table, run by one scan over ticks. Read in this order:
    schedules.py    AFAB, 1F1B, lockstep and interleaved 1F1B as tables (tick x device -> op), `from_orders`
    zero_bubble.py  ZB-H1 and ZB-V: backwards split into B (input gradients) and W (weight gradients)
    zero_bubble_lockstep.py  their tables for cp > 1: F and B in lockstep, W's on ticks of their own
    layout.py       which model stage each chunk of each device holds; the stacked layers' stored order
    buffers.py      the slot a micro-batch occupies from arrival to backward, the transfer lanes
    table.py        schedules by name, the int table the executor reads per tick, validation
    stage.py        what one stage runs (embed / layers / loss from the step specification) and its VJP in slots
    slots.py        the slot buffers; slot_splits.py: how XLA splits their leaves over tp
    executor.py     the scan over ticks (`Plan`, buffers, gradients after); tick.py: one tick, op by op
    step.py         `loss_and_grads` / `mean_loss` for pp > 1: the executor in a shard_map"""
