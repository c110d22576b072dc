"""Tensor parallelism: one model sharded across N executor ranks over torch.distributed.

- `config`: the flags, and where a rank learns its place (the torchrun-style environment);
- `layout`: which heads, MLP columns and vocabulary rows a rank holds; refusal of a size that does not fit;
- `group`: the process groups and the collectives the forward pass calls;
- `plan_channel`: every rank receives the same StepPlan bytes from rank 0;
- `leader` / `follower`: rank 0 (linked to the scheduler, samples) and the others;
- `launcher`: rank 0 starts and watches the local ranks, and ends the group when one dies.
"""
