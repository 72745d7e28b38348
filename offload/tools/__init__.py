"""Tools for the offloading workflow (docs/tools.md): one command per step of the loop.

    python -m offload.tools.bandwidth       # copy bandwidth D2H/H2D/both, pinned and pageable
    python -m offload.tools.profile_modules # per module: forward/backward time, saved bytes
    python -m offload.tools.advise          # what to offload or recompute, for a memory budget
    python -m offload.tools.advisor_check   # the advice against a real run
    python -m offload.tools.overlap         # copy/compute overlap from a torch.profiler trace
    python -m offload.tools.memory          # memory history with and without offloading
    python -m offload.tools.nsys_run        # a training command under nsys, then the overlap report

The core package never imports this one.
"""
