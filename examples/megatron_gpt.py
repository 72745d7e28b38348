"""Train a small GPT or MoE GPT on megatron-core with ``--offload-modules`` (synthetic data).

    python examples/megatron_gpt.py --model gpt --steps 20 --offload-modules=core_attn,fc1
    python examples/megatron_gpt.py --model moe --offload-modules core_attn expert_fc1
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --pp 2 --vpp 2 --offload-modules=core_attn

A complete training loop the way Megatron-LM runs one: megatron-core's local layer spec (no
Transformer Engine), ``Float16Module`` for bf16, Megatron's own ``forward_backward_func``
(no pipelining, 1F1B, or the interleaved schedule with ``--vpp``), an AdamW step. Offloading is
three lines: `add_arguments` on the parser, `apply_from_args` on the model chunks, ``.wrap`` on
the schedule function. Without ``--offload-modules`` they change nothing.

Each run writes ``--json``: the device, the command, per-step losses (exact: ``float.hex``),
a hash of the trained parameters, and per rank the peak memory and the step times (median
after ``--warmup-steps``), plus the engine's statistics. Two runs whose ``loss_hex`` and
``param_sha256`` agree trained bitwise identically. ``--deterministic`` (the default) makes a
run reproducible, which such a comparison needs on a GPU.

MoE: the pinned variant is ``sequential`` (SequentialMLP experts, no linear biases, the
allgather token dispatcher). With linear biases (``sequential-bias``) the expert MLP adds its
bias in place to a view that a custom autograd function returned, and autograd refuses it
(megatron-core 0.16.1 and 0.19.2 alike); ``grouped-gemm`` needs Transformer Engine or the
``grouped_gemm`` package for grouped experts (0.19.2 falls back to SequentialMLP without them).
"""

from __future__ import annotations

import argparse
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

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload.integrations import megatron as megatron_offload  # noqa: E402

PRESETS = {
    "gpt": dict(layers=8, hidden=2048, heads=16, ffn=8192, seq=2048, micro_batch_size=2),
    "moe": dict(layers=8, hidden=1024, heads=8, ffn=4096, seq=2048, micro_batch_size=2,
                experts=8, topk=2, moe_ffn=2048),
}
MOE_VARIANTS = {
    "sequential": dict(add_bias_linear=False, moe_token_dispatcher_type="allgather"),
    "sequential-alltoall": dict(add_bias_linear=False, moe_token_dispatcher_type="alltoall"),
    "sequential-bias": dict(add_bias_linear=True, moe_token_dispatcher_type="allgather"),
    "grouped-gemm": dict(add_bias_linear=False, moe_token_dispatcher_type="allgather", moe_grouped_gemm=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="gpt")
    p.add_argument("--moe-variant", choices=sorted(MOE_VARIANTS), default="sequential")
    for name in ("layers", "hidden", "heads", "ffn", "seq", "micro-batch-size", "experts", "topk", "moe-ffn"):
        p.add_argument(f"--{name}", type=int, default=None, help="overrides the preset")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default 2, or 4 x pp with pipelining)")
    p.add_argument("--steps", type=int, default=22)
    p.add_argument("--warmup-steps", type=int, default=2, help="left out of times and peak memory")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (= world size)")
    p.add_argument("--vpp", type=int, default=1, help="model chunks per stage (interleaved if > 1)")
    p.add_argument("--interleaved", action="store_true",
                   help="use the interleaved schedule even with --vpp 1 (virtual size 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 (always on the CPU)")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    megatron_offload.add_arguments(p)
    args = p.parse_args(argv)
    for key, value in PRESETS[args.model].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.microbatches is None:
        args.microbatches = 2 if args.pp == 1 else 4 * args.pp
    if args.layers % (args.pp * args.vpp):
        p.error(f"--layers {args.layers} is not divisible by pp x vpp = {args.pp * args.vpp}")
    if args.vpp > 1 and args.pp == 1:
        p.error("--vpp > 1 needs --pp > 1 (megatron runs one chunk without pipelining)")
    return args


def init_distributed(args: argparse.Namespace) -> int:
    """Start torch.distributed (torchrun's env, or a one-process group) and Megatron's groups."""
    from megatron.core import parallel_state

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
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

        model_parallel_cuda_manual_seed(args.seed)
    return torch.distributed.get_rank()


def build_chunks(args: argparse.Namespace) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage), bf16 through ``Float16Module``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = args.device == "cuda" and not args.fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    virtual = args.vpp if (args.vpp > 1 or args.interleaved) else None
    kw = dict(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=virtual,
        use_cpu_initialization=args.device == "cpu",
    )
    grouped = False
    if args.model == "moe":
        variant = dict(MOE_VARIANTS[args.moe_variant])
        grouped = variant.pop("moe_grouped_gemm", False)
        kw.update(num_moe_experts=args.experts, moe_router_topk=args.topk,
                  moe_ffn_hidden_size=args.moe_ffn, moe_grouped_gemm=grouped, **variant)
    config = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped)
    chunks = []
    for stage in range(args.vpp):
        torch.manual_seed(args.seed + 1000 * stage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(
                config, spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
            )
        model.to(args.device)
        chunks.append(Float16Module(config, model) if bf16 else model)
    return chunks


def step_batches(args: argparse.Namespace, step: int) -> list[tuple[torch.Tensor, ...]]:
    """The step's microbatches: random tokens from a generator seeded by (seed, step)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    b, s = args.micro_batch_size, args.seq
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


def stats_summary(stats) -> dict:
    if stats is None:
        return {}
    keep = ("groups", "groups_offloaded", "groups_kept", "bytes_offloaded", "bytes_held_elsewhere",
            "reloads_prefetched", "reloads_on_demand", "offload_wait_ms", "reload_wait_ms")
    out = {name: {k: getattr(s, k) for k in keep} | {"d2h_gbps": s.d2h_gbps, "h2d_gbps": s.h2d_gbps}
           for name, s in stats.by_name.items()}
    return {"by_name": out, "pinned_bytes": stats.pinned_bytes, "max_inflight_groups": stats.max_inflight_groups}


def run(args: argparse.Namespace) -> dict:
    """Train ``args.steps`` steps; returns this rank's results."""
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if args.deterministic:  # ops without a deterministic kernel warn; a rerun shows if it matters
        torch.use_deterministic_algorithms(True, warn_only=True)
    rank = init_distributed(args)
    cuda = args.device == "cuda"
    chunks = build_chunks(args)
    handle = megatron_offload.apply_from_args(chunks, args, device=args.device)
    forward_backward = handle.wrap(get_forward_backward_func())
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    interleaved = args.vpp > 1 or args.interleaved

    losses, times = [], []
    setup_bytes = torch.cuda.memory_allocated() if cuda else 0
    for step in range(args.steps):
        if step == args.warmup_steps and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batches = step_batches(args, step)
        data = [iter(batches) for _ in chunks] if interleaved else iter(batches)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        out = forward_backward(
            forward_step_func=forward_step, data_iterator=data,
            model=chunks if interleaved else chunks[0], num_microbatches=args.microbatches,
            seq_length=args.seq, micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append([d["lm loss"].item() for d in out] if out else [])
    sha = hashlib.sha256()
    for p in params:
        sha.update(p.detach().float().cpu().numpy().tobytes())
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return {
        "rank": rank,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "last_stage": is_last,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "megatron_core": megatron.core.__version__,
        "torch": torch.__version__,
        "microbatch_losses": losses if is_last else None,
        "param_sha256": sha.hexdigest(),
        "memory_after_setup_bytes": setup_bytes,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "step_time_ms": times,
        "median_step_time_ms": statistics.median(times[args.warmup_steps:] or times),
        "offload": stats_summary(handle.last_stats),
        "offload_mapping": handle.mapping,
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
        "model": args.model, "moe_variant": args.moe_variant if args.model == "moe" else None,
        "sizes": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "seq", "micro_batch_size",
                                                 "microbatches", "vocab", "experts", "topk", "moe_ffn")},
        "pp": args.pp, "vpp": args.vpp, "interleaved": args.vpp > 1 or args.interleaved,
        "offload_modules": list(megatron_offload.Options.from_args(args).modules),
        "offload_policy": args.offload_policy,
        "steps": args.steps, "warmup_steps": args.warmup_steps, "deterministic": args.deterministic,
        "losses": step_losses,
        "loss_hex": [[float(x).hex() for x in mb] for mb in last.get("microbatch_losses") or []],
        "param_sha256": [r.get("param_sha256") for r in ranks],
        "peak_memory_bytes": [r.get("peak_memory_bytes") for r in ranks],
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
        print(f"[megatron_gpt] ok={ok} model={args.model} pp={args.pp} vpp={args.vpp} "
              f"offload={summary['offload_modules'] or '-'} peak GiB per rank: {peaks}; "
              f"median step ms: {times}; last loss: {step_losses[-1] if step_losses else None}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
