"""Train a small GPT or MoE GPT on megatron-core with ``--offload-modules`` (synthetic data).

    python examples/megatron_gpt.py --model gpt --steps 20 --offload-modules=core_attn,fc1
    python examples/megatron_gpt.py --model moe --offload-modules core_attn expert_fc1
    python examples/megatron_gpt.py --model gpt --offload-modules=auto --offload-memory-budget=-30%
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --pp 2 --vpp 2 --offload-modules=core_attn
    python examples/megatron_gpt.py --model dense_16k --transformer-impl transformer_engine \\
        --offload-modules qkv_linear,core_attn,attn_proj --system megatron

A complete training loop the way Megatron-LM runs one: megatron-core's local layer spec or its
Transformer Engine spec (``--transformer-impl``), ``Float16Module`` for bf16, Megatron's own
``forward_backward_func`` (no pipelining, 1F1B, or the interleaved schedule with ``--vpp``, its
sends and receives set as Megatron-LM sets them: `p2p_kwargs`), an AdamW step. Offloading is
three lines: `add_arguments` on the parser, `apply_from_args` on the model chunks, ``.wrap`` on
the schedule function. Without ``--offload-modules`` they change
nothing. ``--offload-modules=auto`` with ``--offload-memory-budget`` (or
``--offload-memory-budget-gib``) lets the planner choose names and recompute under the budget on
the first step, and prints its table (docs/megatron.md); the flags are checked here, before
anything starts.

``--system megatron`` runs the same model with Megatron's own fine-grained activation offloading
instead (``TransformerConfig.fine_grained_activation_offloading`` and ``offload_modules``, the
names mapped by `to_megatron_names`; it needs Transformer Engine >= 2.14 for CUDA graphs and the
TE spec, and ``NVTE_CPU_OFFLOAD_V1=1``, set here before TE is imported, as Megatron-LM asks).
``--fp8 delayed|current`` trains under TE's delayed or current (``tensorwise``) scaling recipe;
``--cross-entropy-loss-fusion`` computes the loss with Megatron's fused cross entropy (its
``native`` implementation), as Megatron-LM's flag of that name does;
``--recompute-granularity``/``--recompute-modules`` switch on Megatron's recompute;
``--cuda-graph-impl``/``--cuda-graph-modules`` Megatron's CUDA graphs (``transformer_engine``:
both systems run with them, this library capturing the names inside the graphs through
``offload.graphs``; ``local``: Megatron's own offloading only, this library refuses it).

Each run writes ``--json``: the device, the command, per-step losses (exact: ``float.hex``),
a hash of the trained parameters, and per rank the peak memory (plus the CUDA graphs' private
pools), the step times (median after ``--warmup-steps``) and, after each step, the memory
allocators' counts (``memory_counts_per_step``: `memory_counts`), plus the engine's statistics.
Two runs whose ``loss_hex`` and ``param_sha256`` agree trained bitwise identically.
``--alternate-baseline`` alternates the measured steps between offloading and none
(`offload.suspended`), ending with one that offloads, and reports both kinds' median step and
peak (``alternate_baseline``): a comparison that drift between processes cannot bias.
``--peak-trace DIR`` records the allocator's history over the last step (left out of the times
and peaks) and writes what is live at its peak, by allocation site (`offload.tools.peak_live`):
``python -m offload.tools.peak_live A/peak_rank0.json B/peak_rank0.json`` compares two runs.
``--profile-trace DIR`` records the last step (left out the same way) under ``torch.profiler``,
the engine's copies named as in nsys, into ``DIR/trace_rank<R>.json.gz``: ``python -m
offload.tools.overlap report DIR/trace_rank0.json.gz`` says where the compute stream stood idle
and for which copies, for either system's run; ``python -m offload.tools.overlap kernels
A/trace_rank0.json.gz B/trace_rank0.json.gz`` what one run's compute stream ran more of.
``--decision-log DIR`` logs the last step's offloading decisions (left out the same way), each
reload, group backward and first unpack with the allocator's counters and what the engine held
then, and Megatron's reloads and commits for its own offloading (`offload.tools.decision_log`),
into ``DIR/decisions_rank<R>.json``: which groups were on the GPU where the step peaked.
``--device-memory-gib N`` lets the caching allocator hold at most N GiB: runs then compare at
equal device memory, which ``max_memory_allocated`` alone does not show where an offloading frees
tensors its copies still read (``record_stream``; the allocator takes new memory meanwhile).
``--expandable-segments`` lets the allocator grow segments in place, which a deterministic fused
attention backward at long sequences needs (its workspace is heads x sequence^2 x 2 bytes).
``--deterministic`` (the default) makes a run reproducible, which such a comparison needs on a
GPU (and sets ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` for Transformer Engine).

Presets (``--model``; each size flag overrides): ``gpt`` and ``moe`` (the local spec's small
models), and the head-to-head workloads of ``benchmarks/megatron_headtohead.py``, sized for one
80 GB H100: ``dsv3_proxy`` (a DeepSeek-V3-like MoE: multi-latent attention, 32 fine-grained
experts, top-4, SwiGLU, RMSNorm, grouped GEMM; TE spec) and ``dense_16k`` (a Llama-like dense GPT,
GQA, SwiGLU, RoPE, sequence 16384; TE spec).

MoE on the local spec: the pinned variant is ``sequential`` (SequentialMLP experts, no linear
biases, the allgather token dispatcher). With linear biases (``sequential-bias``) the expert MLP
adds its bias in place to a view that a custom autograd function returned, and autograd refuses
it (megatron-core 0.16.1 and 0.19.2 alike); ``grouped-gemm`` builds TEGroupedMLP with the TE
spec, and needs the ``grouped_gemm`` package on the local spec (0.19.2 falls back to
SequentialMLP without it). ``grouped-gemm-capacity`` is ``grouped-gemm`` with the all-to-all
dispatcher dropping and padding every expert to its capacity (capacity factor 1.0): the token
counts are then known on the host, and no MoE layer syncs with it (the dropless dispatchers read
them back every layer, which drains the GPU's queue).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path


def _early_environment(argv: list[str]) -> None:
    """Environment that Transformer Engine reads when it is imported (before megatron-core
    imports it): deterministic attention and eager fusions unless ``--no-deterministic``; TE's
    v1 CPU-offload path for Megatron's own offloading (Megatron-LM's arguments.py requires it for
    TE >= 2.10)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--system", default="offload")
    pre.add_argument("--no-deterministic", action="store_true")
    known, _ = pre.parse_known_args(argv)
    if not known.no_deterministic:
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        # TE's small fusions compile with torch.compile unless 0: eager keeps both runs' kernels the same
        os.environ.setdefault("NVTE_TORCH_COMPILE", "0")
    if known.system == "megatron":
        os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "1")


_early_environment(sys.argv[1:])
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import offload  # noqa: E402
from offload.errors import OffloadError  # noqa: E402
from offload.integrations import megatron as megatron_offload  # noqa: E402
from offload.integrations import megatron_plan  # noqa: E402
from offload.tools import decision_log, overlap, peak_live  # noqa: E402
from offload.tools.report import write_json  # noqa: E402

MLA_SIZES = dict(q_lora_rank=768, kv_lora_rank=256, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
PRESETS = {
    "gpt": dict(layers=8, hidden=2048, heads=16, ffn=8192, seq=2048, micro_batch_size=2),
    "moe": dict(layers=8, hidden=1024, heads=8, ffn=4096, seq=2048, micro_batch_size=2,
                experts=8, topk=2, moe_ffn=2048),
    "dsv3_proxy": dict(layers=8, hidden=2048, heads=16, ffn=8192, seq=8192, micro_batch_size=1, microbatches=4,
                       experts=32, topk=4, moe_ffn=1408, swiglu=True, normalization="RMSNorm", mla=True,
                       transformer_impl="transformer_engine", moe_variant="grouped-gemm", **MLA_SIZES),
    "dense_16k": dict(layers=8, hidden=4096, heads=32, query_groups=8, ffn=14336, seq=16384, micro_batch_size=1,
                      microbatches=2, swiglu=True, normalization="RMSNorm", position_embedding="rope",
                      transformer_impl="transformer_engine"),
}
MOE_MODELS = ("moe", "dsv3_proxy")
MOE_VARIANTS = {
    "sequential": dict(add_bias_linear=False, moe_token_dispatcher_type="allgather"),
    "sequential-alltoall": dict(add_bias_linear=False, moe_token_dispatcher_type="alltoall"),
    "sequential-bias": dict(add_bias_linear=True, moe_token_dispatcher_type="allgather"),
    "grouped-gemm": dict(add_bias_linear=False, moe_token_dispatcher_type="allgather", moe_grouped_gemm=True),
    "grouped-gemm-capacity": dict(add_bias_linear=False, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
                                  moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
}
FP8_RECIPES = {"delayed": "delayed", "current": "tensorwise"}  # TE's current scaling is Megatron's "tensorwise"
DEFAULTS = dict(transformer_impl="local", moe_variant="sequential", normalization="LayerNorm", swiglu=False,
                mla=False, position_embedding="learned_absolute", query_groups=None, microbatches=None,
                **{k: None for k in MLA_SIZES})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="gpt")
    p.add_argument("--moe-variant", choices=sorted(MOE_VARIANTS), default=None)
    for name in ("layers", "hidden", "heads", "query-groups", "ffn", "seq", "micro-batch-size", "experts", "topk",
                 "moe-ffn", *(k.replace("_", "-") for k in MLA_SIZES)):
        p.add_argument(f"--{name}", type=int, default=None, help="overrides the preset")
    p.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="megatron-core's layer spec (default: the preset's, else local); transformer_engine "
                        "needs Transformer Engine")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    p.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None,
                   help="gated SiLU MLPs, no linear biases")
    p.add_argument("--mla", action=argparse.BooleanOptionalAction, default=None, help="multi-latent attention")
    p.add_argument("--position-embedding", choices=["learned_absolute", "rope"], default=None)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default: the preset's, else 2, or 4 x pp with pipelining)")
    p.add_argument("--steps", type=int, default=22)
    p.add_argument("--warmup-steps", type=int, default=2, help="left out of times and peak memory")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (= world size)")
    p.add_argument("--vpp", type=int, default=1, help="model chunks per stage (interleaved if > 1)")
    p.add_argument("--interleaved", action="store_true",
                   help="use the interleaved schedule even with --vpp 1 (virtual size 1)")
    p.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
                   help="with --vpp > 1, batched pipeline sends and receives followed by a device "
                        "synchronize, instead of Megatron-LM's default for the interleaved schedule "
                        "(sends and receives overlapped with compute)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 (always on the CPU)")
    p.add_argument("--fp8", choices=sorted(FP8_RECIPES), default=None,
                   help="FP8 with Transformer Engine's delayed or current scaling (hybrid E4M3/E5M2)")
    p.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="Megatron's fused cross entropy (native) instead of the unfused fp32 one")
    p.add_argument("--system", choices=["offload", "megatron"], default="offload",
                   help="whose offloading --offload-modules switches on: this library's, or Megatron's own "
                        "--fine-grained-activation-offloading (needs Transformer Engine)")
    p.add_argument("--recompute-granularity", choices=["selective", "full"], default=None)
    p.add_argument("--recompute-modules", default=None, metavar="NAMES",
                   help="Megatron's selective recompute modules, comma-separated (core_attn, layernorm, moe_act, "
                        "mla_up_proj, mlp, moe, shared_experts); implies --recompute-granularity selective")
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--cuda-graph-impl", choices=["none", "local", "transformer_engine"], default="none",
                   help="Megatron's CUDA graphs (transformer_engine: through TECudaGraphHelper, as in "
                        "Megatron-LM's training loop)")
    p.add_argument("--cuda-graph-modules", default="", metavar="REGIONS",
                   help="per-layer capture regions, comma-separated (attn, mlp, moe, moe_router, moe_preprocess); "
                        "empty: whole layers (megatron-core 0.16 calls it --cuda-graph-scope)")
    p.add_argument("--cuda-graph-warmup-steps", type=int, default=3)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    p.add_argument("--peak-trace", type=Path, default=None, metavar="DIR",
                   help="record the allocator's history over the last step (not timed) and write what is live "
                        "at its peak, by allocation site, to DIR/peak_rank<R>.json (offload.tools.peak_live)")
    p.add_argument("--profile-trace", type=Path, default=None, metavar="DIR",
                   help="record the last step (not timed) under torch.profiler into DIR/trace_rank<R>.json.gz "
                        "(offload.tools.overlap report)")
    p.add_argument("--decision-log", type=Path, default=None, metavar="DIR",
                   help="log the last step's offloading decisions (not timed) with the allocator's counters to "
                        "DIR/decisions_rank<R>.json (offload.tools.decision_log)")
    p.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                   help="the most device memory the caching allocator may hold (set_per_process_memory_fraction): "
                        "a block freed while a copy still reads it (record_stream) counts until the copy is done, "
                        "so two systems compare at equal device memory; past it the allocator synchronizes, "
                        "frees its cache and retries (alloc_retries), then raises out of memory")
    p.add_argument("--expandable-segments", action="store_true",
                   help="let the caching allocator grow segments in place (expandable_segments:True), so a "
                        "large request reuses what freed blocks leave: Transformer Engine's deterministic fused "
                        "attention backward asks for heads x sequence^2 x 2 bytes (64 GiB at 128 heads and "
                        "16384 tokens), which otherwise fails with tens of GiB reserved but unallocated")
    p.add_argument("--alternate-baseline", action="store_true",
                   help="measured steps alternate between offloading and none (offload.suspended), the last "
                        "one offloading: both step times and peaks come from this one process")
    megatron_offload.add_arguments(p)
    args = p.parse_args(argv)
    for key, value in {**DEFAULTS, **PRESETS[args.model]}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.microbatches is None:
        args.microbatches = 2 if args.pp == 1 else 4 * args.pp
    if args.recompute_modules is not None and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.layers % (args.pp * args.vpp):
        p.error(f"--layers {args.layers} is not divisible by pp x vpp = {args.pp * args.vpp}")
    if args.vpp > 1 and args.pp == 1:
        p.error("--vpp > 1 needs --pp > 1 (megatron runs one chunk without pipelining)")
    if args.cuda_graph_impl != "none" and args.device != "cuda":
        p.error("--cuda-graph-impl needs --device cuda")
    if args.cuda_graph_impl != "none" and args.warmup_steps < args.cuda_graph_warmup_steps + 2:
        p.error(f"--warmup-steps {args.warmup_steps} must be at least --cuda-graph-warmup-steps + 2 "
                f"({args.cuda_graph_warmup_steps + 2}): the graphs' warm-up and capture steps are not timed")
    if args.alternate_baseline:
        if args.system != "offload" or not offload_modules(args):
            p.error("--alternate-baseline compares this library's offloading with none in one process: it needs "
                    "--system offload and --offload-modules")
        if args.cuda_graph_impl != "none":
            p.error("--alternate-baseline cannot suspend groups captured in CUDA graphs (their replays copy as "
                    "captured): use --cuda-graph-impl none, or compare two runs")
        if args.steps - args.warmup_steps < 2:
            p.error(f"--alternate-baseline needs at least 2 measured steps (--steps {args.steps}, --warmup-steps "
                    f"{args.warmup_steps})")
    if args.peak_trace is not None and args.device != "cuda":
        p.error("--peak-trace records the CUDA allocator's history: it needs --device cuda")
    traces = [f"--{dest.replace('_', '-')}" for dest in last_step_recorders(args)]
    if len(traces) > 1:
        p.error(f"{' and '.join(traces)} each record the last step: give one")
    if traces and args.steps - args.warmup_steps < 2:
        p.error(f"{traces[0]} leaves its step out of the times: it needs at least 2 measured steps "
                f"(--steps {args.steps}, --warmup-steps {args.warmup_steps})")
    if args.device_memory_gib is not None:
        if args.device != "cuda":
            p.error("--device-memory-gib caps the CUDA caching allocator: it needs --device cuda")
        if not args.device_memory_gib > 0:
            p.error(f"--device-memory-gib {args.device_memory_gib}: give a positive number of GiB")
    if args.expandable_segments and args.device != "cuda":
        p.error("--expandable-segments sets the CUDA caching allocator: it needs --device cuda")
    try:  # the offload flags, before any process group or model exists
        opts = megatron_offload.Options.from_args(args)
        if opts.auto:
            megatron_plan.check_auto(argparse.Namespace(**config_kwargs(args)))
    except OffloadError as exc:
        p.error(str(exc))
    engine_flags = opts.engine_flags_set() if args.system == "megatron" else []
    if engine_flags:
        p.error(f"{', '.join(engine_flags)}: this library's engine settings; Megatron's own offloading "
                "(--system megatron) has none of them. Drop them, or use --system offload")
    check_transformer_engine(args, p.error)
    return args


def transformer_engine_error() -> str | None:
    """Why ``transformer_engine.pytorch`` does not import here, or ``None`` when it does."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or an OSError from a missing CUDA/cuDNN library
        return f"{type(exc).__name__}: {exc}"
    return None


def check_transformer_engine(args: argparse.Namespace, fail) -> None:
    """Call ``fail(message)`` for flags that need Transformer Engine where it does not import,
    or the TE layer spec where another is chosen."""
    if args.system == "megatron" and args.transformer_impl != "transformer_engine":
        fail("--system megatron needs --transformer-impl transformer_engine (Megatron's own offloading "
             "hooks Transformer Engine's CPU-offload state; Megatron-LM's arguments.py asserts the same)")
    if args.fp8 and args.transformer_impl != "transformer_engine":
        fail(f"--fp8 {args.fp8} needs --transformer-impl transformer_engine")
    if args.cuda_graph_impl == "transformer_engine" and args.transformer_impl != "transformer_engine":
        fail("--cuda-graph-impl transformer_engine needs --transformer-impl transformer_engine")
    if args.transformer_impl == "transformer_engine":
        why = transformer_engine_error()
        if why is not None:
            fail(f"--transformer-impl transformer_engine (model {args.model!r}) needs Transformer Engine, which "
                 f"does not import here ({why}); install it (docs/te.md) or use --transformer-impl local")


def cap_device_memory(gib: float) -> None:
    """Let this process's caching allocator hold at most ``gib`` GiB of the current device."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 > total:
        raise SystemExit(f"--device-memory-gib {gib}: the device has {total / 2**30:.2f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)


def init_distributed(args: argparse.Namespace) -> int:
    """Start torch.distributed (torchrun's env, or a one-process group) and Megatron's groups."""
    from megatron.core import parallel_state

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if args.expandable_segments:  # before the first allocation: every segment is expandable
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        if args.device_memory_gib is not None:
            cap_device_memory(args.device_memory_gib)
    if not torch.distributed.is_initialized():
        backend = "nccl" if args.device == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group(backend)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                                 rank=0, world_size=1)
    world = torch.distributed.get_world_size()
    if world != args.pp:
        raise SystemExit(f"world size {world} != --pp {args.pp} (this example has no data parallelism)")
    virtual = args.vpp if (args.vpp > 1 or args.interleaved) else None
    parallel_state.initialize_model_parallel(1, args.pp, virtual_pipeline_model_parallel_size=virtual)
    if args.device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # As Megatron's training seeds for CUDA graphs: graph-safe RNG states (TE's graph capture
        # takes every registered generator's state; a plain tracker's states are tensors).
        model_parallel_cuda_manual_seed(args.seed, te_rng_tracker=args.cuda_graph_impl == "transformer_engine",
                                        use_cudagraphable_rng=args.cuda_graph_impl != "none")
    if args.cuda_graph_impl == "transformer_engine":  # TECudaGraphHelper asks get_num_microbatches()
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

        init_num_microbatches_calculator(0, None, args.micro_batch_size * args.microbatches,
                                         args.micro_batch_size, 1)
    return torch.distributed.get_rank()


def offload_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """The names of ``--offload-modules`` (checked against the integration's table)."""
    return megatron_offload.Options.from_args(args).modules


def p2p_kwargs(args: argparse.Namespace) -> dict:
    """How pipeline stages exchange tensors, as Megatron-LM's training sets it (``validate_args``):
    with the interleaved schedule (``--vpp`` > 1), sends and receives overlap compute unless
    ``--no-overlap-p2p-communication``; otherwise they are batched, and megatron-core follows
    each batch with ``torch.cuda.synchronize()`` (``batch_p2p_sync``), which waits for every
    stream of the device, offloading's copies included."""
    overlap = args.vpp > 1 and args.overlap_p2p_comm
    return {"overlap_p2p_comm": overlap, "batch_p2p_comm": not overlap}


def config_kwargs(args: argparse.Namespace) -> dict:
    """The ``TransformerConfig`` fields the flags set."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    bf16 = args.device == "cuda" and not args.fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    virtual = args.vpp if (args.vpp > 1 or args.interleaved) else None
    kw: dict = dict(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=virtual,
        use_cpu_initialization=args.device == "cpu", normalization=args.normalization,
        **p2p_kwargs(args),
    )
    if "transformer_impl" in fields:
        kw["transformer_impl"] = args.transformer_impl
    if args.query_groups:
        kw["num_query_groups"] = args.query_groups
    if args.swiglu:
        kw.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False)
    if args.mla:
        kw.update(multi_latent_attention=True, rope_type="rope", **{k: getattr(args, k) for k in MLA_SIZES})
    if args.model in MOE_MODELS:
        variant = dict(MOE_VARIANTS[args.moe_variant])
        if args.swiglu:
            variant["add_bias_linear"] = False
        kw.update(num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.moe_ffn,
                  moe_grouped_gemm=variant.pop("moe_grouped_gemm", False), **variant)
    if args.fp8:
        kw.update(fp8="hybrid", fp8_recipe=FP8_RECIPES[args.fp8])
    if args.cross_entropy_loss_fusion:
        kw.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    if args.recompute_granularity:
        kw["recompute_granularity"] = args.recompute_granularity
        if args.recompute_modules is not None:
            kw["recompute_modules"] = [m for m in args.recompute_modules.split(",") if m]
        if args.recompute_granularity == "full":
            kw.update(recompute_method=args.recompute_method or "uniform",
                      recompute_num_layers=args.recompute_num_layers or 1)
    if args.cuda_graph_impl != "none":
        regions = [r for r in args.cuda_graph_modules.split(",") if r]
        kw["cuda_graph_impl"] = args.cuda_graph_impl
        kw["cuda_graph_modules" if "cuda_graph_modules" in fields else "cuda_graph_scope"] = regions
        kw["cuda_graph_warmup_steps"] = args.cuda_graph_warmup_steps
    if args.system == "megatron" and offload_modules(args):
        elem = torch.empty((), dtype=dtype).element_size()
        kw.update(fine_grained_activation_offloading=True,
                  offload_modules=megatron_offload.to_megatron_names(offload_modules(args)),
                  min_offloaded_tensor_size=args.offload_min_tensor_bytes // elem)  # Megatron counts elements
    return kw


def layer_spec(args: argparse.Namespace, config):
    """megatron-core's local or Transformer Engine layer spec for ``config``."""
    from megatron.core.models.gpt import gpt_layer_specs

    grouped = bool(config.moe_grouped_gemm)
    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=grouped, multi_latent_attention=args.mla)
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=grouped, multi_latent_attention=args.mla)


def build_chunks(args: argparse.Namespace) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage), bf16 through ``Float16Module``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = config_kwargs(args)
    rope = args.position_embedding == "rope" or args.mla
    if "position_embedding_type" in TransformerConfig.__dataclass_fields__:  # 0.19 reads it from the config
        kw["position_embedding_type"] = "rope" if rope else "learned_absolute"
    config = (MLATransformerConfig if args.mla else TransformerConfig)(**kw)
    spec = layer_spec(args, config)
    chunks = []
    for stage in range(args.vpp):
        torch.manual_seed(args.seed + 1000 * stage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(
                config, spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage, position_embedding_type="rope" if rope else "learned_absolute",
            )
        model.to(args.device)
        chunks.append(Float16Module(config, model) if config.bf16 else model)
    if args.system == "megatron" and offload_modules(args):
        # the same names must mean the same modules: a norm fused into the next linear layer
        # (TE spec) needs that layer's name, or Megatron would drop it silently
        megatron_offload.to_megatron_names(offload_modules(args), [megatron_offload.find_modules(c) for c in chunks])
    return chunks


def step_batches(args: argparse.Namespace, step: int) -> list[tuple]:
    """The step's microbatches: random tokens from a generator seeded by (seed, step). The TE
    spec's attention is causal by its mask type and takes no mask tensor."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    b, s = args.micro_batch_size, args.seq
    mask = None
    if args.transformer_impl == "local":
        mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1).to(args.device)
    pos = torch.arange(s).expand(b, s).to(args.device)
    out = []
    for _ in range(args.microbatches):
        tokens = torch.randint(0, args.vocab, (b, s + 1), generator=g).to(args.device)
        out.append((tokens[:, :-1], pos, mask, tokens[:, 1:]))
    return out


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: the model's per-token loss, and how to reduce it."""
    tokens, pos, mask, labels = next(data_iterator)
    output = model(tokens, pos, mask, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


ALLOCATOR_COUNTS = {"device_allocs": "num_device_alloc", "device_frees": "num_device_free",
                    "alloc_retries": "num_alloc_retries", "syncs_all_streams": "num_sync_all_streams"}


LAST_STEP_RECORDERS = ("peak_trace", "profile_trace", "decision_log")  # the flags' dests; at most one given


def last_step_recorders(args: argparse.Namespace) -> list[str]:
    """The dests of `LAST_STEP_RECORDERS` that ``args`` gives (each records the last step)."""
    return [dest for dest in LAST_STEP_RECORDERS if getattr(args, dest) is not None]


@contextlib.contextmanager
def step_recording(args: argparse.Namespace, traced: bool):
    """What records the step (``--peak-trace``: the allocator's history; ``--profile-trace``:
    ``torch.profiler``, the engine's ranges mirrored into it; ``--decision-log``: the
    offloading decisions); nothing for an untraced step."""
    if not traced:
        yield None
    elif args.peak_trace is not None:
        with peak_live.record() as recording:
            yield recording
    elif args.decision_log is not None:
        with decision_log.record() as entries:
            yield entries
    else:
        from torch.profiler import ProfilerActivity, profile

        from offload.tools.profiler_ranges import profiler_ranges

        cuda = args.device == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profiler_ranges(), profile(activities=activities) as prof:
            yield prof
            if cuda:
                torch.cuda.synchronize()


def memory_counts(memory_stats: dict, stats) -> dict:
    """Cumulative counts after a step: the CUDA caching allocator's ``cudaMalloc`` and ``cudaFree``
    calls, its retries after emptying its cache and its waits for every stream (each a
    synchronize), and this library's pinned host allocations (``None`` without its statistics).
    A step that is slower than the steady ones while these grow paid for memory, not for copies."""
    out = {key: memory_stats.get(name, 0) for key, name in ALLOCATOR_COUNTS.items()}
    out["pinned_allocations"] = None if stats is None else stats.pinned_allocations
    return out


def stats_summary(stats, timed=None) -> dict:
    """The last step's engine statistics (``stats``) and, per name, the waits and copy rates of
    the latest timed one (``timed``: with ``OffloadConfig.timing`` every step is timed, else only
    the three the copy-wait notice measures after two warm-up steps), with that step's number
    (``timed_iteration``, None if no step was timed)."""
    if stats is None:
        return {}
    keep = ("groups", "groups_offloaded", "groups_kept", "bytes_offloaded", "bytes_held_elsewhere",
            "reloads_prefetched", "reloads_on_demand")
    out = {name: {k: getattr(s, k) for k in keep} for name, s in stats.by_name.items()}
    timed = stats if stats.timed else timed
    for name, s in (timed.by_name.items() if timed is not None else ()):
        out.setdefault(name, {}).update(
            offload_wait_ms=s.offload_wait_ms, flush_wait_ms=s.flush_wait_ms, reload_wait_ms=s.reload_wait_ms,
            d2h_gbps=s.d2h_gbps, h2d_gbps=s.h2d_gbps)
    return {"by_name": out, "pinned_bytes": stats.pinned_bytes, "max_inflight_groups": stats.max_inflight_groups,
            "timed_iteration": None if timed is None else timed.iteration}


def te_graph_helper(args: argparse.Namespace, chunks: list[torch.nn.Module]):
    """Megatron's TECudaGraphHelper for ``--cuda-graph-impl transformer_engine``, as Megatron-LM's
    training loop makes it (``create_cudagraphs()`` once ``--cuda-graph-warmup-steps`` steps ran).
    Its reset after the capture zeroes each chunk's grad buffer, which only Megatron's DDP has:
    a plain ``zero_grad`` stands in."""
    if args.cuda_graph_impl != "transformer_engine":
        return None
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
    from megatron.core.utils import get_model_config

    for chunk in chunks:
        if not hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer = lambda chunk=chunk: chunk.zero_grad(set_to_none=False)
    return TECudaGraphHelper(model=chunks, config=get_model_config(chunks[0]), seq_length=args.seq,
                             micro_batch_size=args.micro_batch_size, optimizers=[])


def drop_autograd_history_kept_by_modules(chunks: list[torch.nn.Module]) -> int:
    """Detach every tensor with autograd history that a module, or a plain object a module holds,
    keeps as an attribute; how many.

    Megatron's allgather token dispatcher keeps the last microbatch's ``local_probs`` on itself
    after the step, and with it that microbatch's autograd graph back to the attention's
    parameters: their ``AccumulateGrad`` nodes stay alive, made on the default stream by the
    eager steps. Transformer Engine's capture of the attention's backward then reaches them and
    fails (``cudaErrorStreamCaptureImplicit``: the default stream would depend on the capture;
    PyTorch warns first that the node's stream does not match). Nothing reads those attributes
    before the next forward sets them again, so the capture starts from their detached values.
    """
    holders = [m for chunk in chunks for m in chunk.modules()]
    holders += [v for m in holders for v in vars(m).values()  # the dispatcher is not a module
                if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))]
    dropped = 0
    for holder in holders:
        for name, value in list(vars(holder).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(holder, name, value.detach())
                dropped += 1
    return dropped


def graph_pool_bytes(cuda: bool) -> int:
    """Bytes the CUDA graphs' private pools hold (``max_memory_allocated`` does not show them)."""
    if not cuda:
        return 0
    from offload.testing import graph_pool_bytes as pools

    return pools()


def run(args: argparse.Namespace) -> dict:
    """Train ``args.steps`` steps; returns this rank's results."""
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    if args.deterministic:  # ops without a deterministic kernel warn; a rerun shows if it matters
        torch.use_deterministic_algorithms(True, warn_only=True)
    rank = init_distributed(args)
    cuda = args.device == "cuda"
    chunks = build_chunks(args)
    if args.system == "offload":
        handle = megatron_offload.apply_from_args(chunks, args, device=args.device)
    else:  # Megatron's own offloading is in the config; nothing to attach
        handle = megatron_offload.apply(chunks, ())
    forward_backward = handle.wrap(get_forward_backward_func())
    graphs = te_graph_helper(args, chunks)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    interleaved = args.vpp > 1 or args.interleaved

    losses, times = [], []
    baseline_times, peaks = [], {True: 0, False: 0}  # peaks: offloading on / suspended
    reserved = {True: 0, False: 0}  # the same for the allocator's segments (see "peak_reserved_bytes")
    counts = []  # memory_counts after each step (on the GPU)
    timed_stats = None  # the engine's statistics of the latest step whose copies and waits were timed
    setup_bytes = torch.cuda.memory_allocated() if cuda else 0
    for step in range(args.steps):
        if graphs is not None and step == args.cuda_graph_warmup_steps:
            drop_autograd_history_kept_by_modules(chunks)
            graphs.create_cudagraphs()
        measured = step >= args.warmup_steps
        traced = bool(last_step_recorders(args)) and step == args.steps - 1
        offloading = not (args.alternate_baseline and measured and (args.steps - 1 - step) % 2)
        batches = step_batches(args, step)
        data = [iter(batches) for _ in chunks] if interleaved else iter(batches)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with step_recording(args, traced) as recording:
            optimizer.zero_grad(set_to_none=False)
            with contextlib.nullcontext() if offloading else offload.suspended():
                out = forward_backward(
                    forward_step_func=forward_step, data_iterator=data,
                    model=chunks if interleaved else chunks[0], num_microbatches=args.microbatches,
                    seq_length=args.seq, micro_batch_size=args.micro_batch_size, forward_only=False,
                )
            optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if traced and args.peak_trace is not None:  # a recording slows the step: its time and peak are left out
            summary = peak_live.summarize(recording["snapshot"], recording["start_bytes"],
                                          torch.cuda.current_device())
            write_json(args.peak_trace / f"peak_rank{rank}.json", {"command": sys.argv, **summary})
        elif traced and args.decision_log is not None:
            write_json(args.decision_log / f"decisions_rank{rank}.json",
                       {"command": sys.argv, **decision_log.summarize(recording), "log": recording})
        elif traced:
            overlap.export_trace(recording, args.profile_trace / f"trace_rank{rank}.json.gz")
        else:
            (times if offloading else baseline_times).append((time.perf_counter() - start) * 1e3)
        if cuda and measured and not traced:
            peaks[offloading] = max(peaks[offloading], torch.cuda.max_memory_allocated())
            reserved[offloading] = max(reserved[offloading], torch.cuda.max_memory_reserved())
        if cuda:
            counts.append(memory_counts(torch.cuda.memory_stats(), handle.last_stats))
        if handle.last_stats is not None and handle.last_stats.timed:
            timed_stats = handle.last_stats
        losses.append([d["lm loss"].item() for d in out] if out else [])
    pools = graph_pool_bytes(cuda)
    if graphs is not None and graphs.graphs_created():
        graphs.delete_cuda_graphs()
    sha = hashlib.sha256()
    for p in params:
        sha.update(p.detach().float().cpu().numpy().tobytes())
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    mode = megatron_offload.cuda_graph_mode(get_model_config(chunks[0]))
    return {
        "rank": rank,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "last_stage": is_last,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "megatron_core": megatron.core.__version__,
        "torch": torch.__version__,
        "cuda_graph": "none" if mode is None else mode.label,
        "microbatch_losses": losses if is_last else None,
        "param_sha256": sha.hexdigest(),
        "memory_after_setup_bytes": setup_bytes,
        "peak_memory_bytes": peaks[True] if cuda else None,
        # The segments the caching allocator held at most: a block freed while another stream still
        # uses it (record_stream) leaves max_memory_allocated at once, but is handed out again
        # only after that use, so where that matters only this shows the memory it kept.
        "peak_reserved_bytes": reserved[True] if cuda else None,
        "graph_pool_bytes": pools,
        "step_time_ms": times,
        "memory_counts_per_step": counts,
        "median_step_time_ms": statistics.median(times[args.warmup_steps:] or times),
        "alternate_baseline": None if not args.alternate_baseline else {
            "step_time_ms": baseline_times, "median_step_time_ms": statistics.median(baseline_times),
            "peak_memory_bytes": peaks[False] if cuda else None,
            "peak_reserved_bytes": reserved[False] if cuda else None,
        },
        "offload": stats_summary(handle.last_stats, timed_stats),
        "offload_captured": offload.get_manager().captures.captured_summary(),  # not in "offload"
        "offload_mapping": handle.mapping,
        "offload_plan": None if handle.plan is None else handle.plan.as_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict = {"ok": False}
    try:
        result = {"ok": True, **run(args)}
    except Exception:
        result = {"ok": False, "rank": int(os.environ.get("RANK", 0)), "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr, flush=True)
    ranks = [result]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, result)
    ok = all(r["ok"] for r in ranks)
    last = next((r for r in ranks if r.get("last_stage")), {})
    step_losses = [sum(mb) / len(mb) for mb in last.get("microbatch_losses") or [] if mb]
    summary = {
        "ok": ok,
        "command": shlex.join(["python", "examples/megatron_gpt.py", *(sys.argv[1:] if argv is None else argv)]),
        "device": ranks[0].get("device_name"),
        "megatron_core": ranks[0].get("megatron_core"),
        "torch": torch.__version__,
        "model": args.model, "moe_variant": args.moe_variant if args.model in MOE_MODELS else None,
        "transformer_impl": args.transformer_impl, "system": args.system, "fp8": args.fp8,
        "cross_entropy_loss_fusion": args.cross_entropy_loss_fusion,
        "cuda_graph": ranks[0].get("cuda_graph"),
        "recompute": {"granularity": args.recompute_granularity, "modules": args.recompute_modules},
        "sizes": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "query_groups", "ffn", "seq",
                                                 "micro_batch_size", "microbatches", "vocab", "experts", "topk",
                                                 "moe_ffn", "mla", "swiglu", "normalization")},
        "pp": args.pp, "vpp": args.vpp, "interleaved": args.vpp > 1 or args.interleaved,
        "overlap_p2p_comm": p2p_kwargs(args)["overlap_p2p_comm"],
        "offload_modules": list(offload_modules(args)),
        "offload_policy": args.offload_policy,
        "offload_memory_budget": str(megatron_offload.Options.from_args(args).memory_budget or "") or None,
        "offload_plan": ranks[0].get("offload_plan"),
        "steps": args.steps, "warmup_steps": args.warmup_steps, "deterministic": args.deterministic,
        "device_memory_gib": args.device_memory_gib,
        "losses": step_losses,
        "loss_hex": [[float(x).hex() for x in mb] for mb in last.get("microbatch_losses") or []],
        "param_sha256": [r.get("param_sha256") for r in ranks],
        "peak_memory_bytes": [r.get("peak_memory_bytes") for r in ranks],
        "graph_pool_bytes": [r.get("graph_pool_bytes") for r in ranks],
        "median_step_time_ms": [r.get("median_step_time_ms") for r in ranks],
        "per_rank": ranks,
    }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=1))
        peaks = ", ".join(f"{(p or 0) / 2**30:.2f}" for p in summary["peak_memory_bytes"])
        times = ", ".join(f"{t:.1f}" for t in summary["median_step_time_ms"] if t is not None)
        print(f"[megatron_gpt] ok={ok} model={args.model} system={args.system} pp={args.pp} vpp={args.vpp} "
              f"offload={summary['offload_modules'] or '-'} graphs={summary['cuda_graph']} peak GiB per rank: {peaks}; "
              f"median step ms: {times}; last loss: {step_losses[-1] if step_losses else None}", flush=True)
        for r in ranks if args.alternate_baseline and ok else ():
            alt = r.get("alternate_baseline") or {}
            print(f"[megatron_gpt] rank {r.get('rank')}: the alternate steps without offloading: median step ms "
                  f"{alt.get('median_step_time_ms', float('nan')):.1f}, peak GiB "
                  f"{(alt.get('peak_memory_bytes') or 0) / 2**30:.2f}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
