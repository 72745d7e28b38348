"""Framework integrations of `offload`, one module per framework.

Each module imports its framework when it is imported itself; the core engine never imports
them. ``offload.integrations.megatron``: the ``--offload-modules`` flag for megatron-core.
"""
