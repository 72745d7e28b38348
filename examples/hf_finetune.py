"""Fine-tune a transformers model with activation offloading, by offload name (`offload.presets`).

    python examples/hf_finetune.py --model llama --offload-modules core_attn,fc1
    python examples/hf_finetune.py --model qwen3_moe --offload-modules core_attn,experts --fsdp2
    python examples/hf_finetune.py --model llama --size 1b --seq 8192 --batch 1 --memory-budget=-25%
    python examples/hf_finetune.py --model llama --gradient-checkpointing --offload-modules layer
    python examples/hf_finetune.py --model all --size tiny --steps 2 --device cpu   # the CPU test

A Llama or Qwen3-MoE model is initialised at random from a config (nothing is downloaded) and
trained on synthetic tokens twice from the same seed: without offloading, then with the names
of ``--offload-modules`` offloaded, each run in a process of its own (so that neither inherits
the other's allocator state; under ``torchrun`` both run in the ranks' processes). The script
prints each run's peak memory and step time on CUDA, what was offloaded per step, and checks
that both runs' losses and final weights are bitwise equal (it exits non-zero when they are
not). ``--fsdp2`` shards each decoder layer with ``fully_shard`` (one process, or every rank
under ``torchrun``). ``--memory-budget`` lets the planner (`offload.plan`, docs/planner.md)
choose among the names and the decoder layers what to offload and what to recompute for that
budget, after the first step (so that it sees the optimizer state), on a batch of its own.
``--gradient-checkpointing`` checkpoints every decoder layer in both runs; the name ``layer`` then
offloads the inputs the checkpoints keep.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: bitwise comparison
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import offload  # noqa: E402

SIZES = {
    # name: (hidden, layers, heads, kv heads, dense ffn, experts, experts per token, expert ffn, vocab)
    "tiny": (64, 2, 4, 2, 128, 4, 2, 32, 128),
    "small": (1024, 8, 16, 4, 2816, 16, 2, 512, 32000),
    "1b": (2048, 16, 32, 8, 5632, 32, 4, 1024, 32000),
}
DEFAULT_NAMES = {
    "llama": "core_attn,qkv_linear,fc1,mlp_act,fc2",
    "qwen3_moe": "core_attn,qkv_linear,router,experts",
}
PLAN_NAMES = {  # what the planner chooses among by default: names of one module each (q/k/v are three)
    "llama": "attn_norm,core_attn,attn_proj,mlp_norm,mlp_act,fc2",
    "qwen3_moe": "attn_norm,core_attn,attn_proj,mlp_norm,experts",
}


def build_config(model: str, size: str, seq: int, attn: str, layers: int | None = None) -> object:
    from transformers import AutoConfig

    hidden, size_layers, heads, kv, ffn, experts, topk, expert_ffn, vocab = SIZES[size]
    layers = layers or size_layers
    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, head_dim=hidden // heads, intermediate_size=ffn,
              max_position_embeddings=max(seq, 64), use_cache=False, attn_implementation=attn)
    if model == "qwen3_moe":
        kw.update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=expert_ffn)
    return AutoConfig.for_model(model, **kw)


def build_model(config: object, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).train()


def start_distributed(device: torch.device) -> object:
    """A process group (``torchrun``'s, or one of a single rank) and a 1-D device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(args: argparse.Namespace, model_name: str, names: str | None, mesh: object) -> dict:
    """``args.steps`` AdamW steps; returns the losses, final weights (on the CPU), step times,
    peak memory and offloaded bytes per step."""
    device = torch.device(args.device)
    config = build_config(model_name, args.size, args.seq, args.attn, args.layers)
    model = build_model(config, device, args.dtype)
    if args.gradient_checkpointing:  # before attach: the names are checked against it
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23's name
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
    planned = bool(names and args.memory_budget)
    if planned:
        offload.configure((), device=device)  # nothing offloaded before the plan
    elif names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback saves nothing: said below
            offload.configure(names, min_tensor_bytes=args.min_tensor_bytes, device=device)
        offload.attach(model, names)  # the names of offload.presets (docs/hf.md)
    if mesh is not None:
        shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    out = {"losses": [], "ms": [], "offloaded": [], "peak": None, "plan": None,
           "params": sum(p.numel() for p in model.parameters())}
    for step in range(args.steps):
        if planned and step == 1:
            out["plan"] = plan(args, model, config, names)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
        if step == 1 and device.type == "cuda":  # step 0 allocates the optimizer state: warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if names:
            out["offloaded"].append(offload.end_iteration().total().bytes_offloaded)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out["ms"].append((time.perf_counter() - start) * 1e3)
        out["losses"].append(loss.detach().float().item().hex())
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated() / 2**20
    out["weights"] = weight_digests(model)
    if planned and offload.planner.active_plan() is not None:
        offload.planner.active_plan().remove()
    if names:
        offload.reset(release_pool=True)
    return out


def plan(args: argparse.Namespace, model: nn.Module, config: object, names: str) -> dict:
    """Plan and apply offloading and recompute for ``args.memory_budget`` on a batch of its own
    (`offload.plan` profiles and checks with forward and backward passes, no optimizer step);
    the gradients it leaves are zeroed, so the next step starts as it would without it."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(args.device)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    chosen = offload.plan(model, names, step, args.memory_budget, min_tensor_bytes=args.min_tensor_bytes,
                          verbose=False)
    model.zero_grad(set_to_none=False)
    print(chosen.table(), flush=True)
    return {"offload": list(chosen.assignment.offload), "checkpoint": list(chosen.assignment.checkpoint)}


def run_names(names: str, off: dict, args: argparse.Namespace) -> str:
    """What the offloading run did, for the report and the record: the names, or the plan."""
    if off["plan"] is None:
        return names
    chosen = off["plan"]
    return (f"plan at {args.memory_budget} among {names}: offload {','.join(chosen['offload']) or '-'}; "
            f"recompute {','.join(chosen['checkpoint']) or '-'}")


def world_size() -> int:
    """The ranks ``torchrun`` started (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def release_memory(args: argparse.Namespace) -> float:
    """Free what the first run of this process left (its model and optimizer sit in reference
    cycles until collected); returns the MiB still allocated, which the second run's peak counts too."""
    gc.collect()
    if torch.device(args.device).type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**20


def setup(args: argparse.Namespace) -> str:
    """What the report and the record say of the run's setup beyond the model's size."""
    fsdp2 = (f", FSDP2 over {world_size()} ranks" if world_size() > 1 else ", FSDP2") if args.fsdp2 else ""
    return fsdp2 + (", gradient checkpointing" if args.gradient_checkpointing else "")


def weight_digests(model: nn.Module) -> dict[str, str]:
    """The SHA-256 of each parameter's bytes (the full tensor under FSDP2): equal digests,
    bitwise equal weights."""
    digests = {}
    for name, p in model.named_parameters():
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        digests[name] = hashlib.sha256(full.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    return digests


def compare(plain: dict, off: dict) -> str | None:
    """``None`` if both runs' losses and final weights are bitwise equal."""
    for i, (a, b) in enumerate(zip(plain["losses"], off["losses"])):
        if a != b:
            return f"loss of step {i}: {float.fromhex(a)!r} vs {float.fromhex(b)!r}"
    for name, a in plain["weights"].items():
        if a != off["weights"][name]:
            return f"weight {name} differs"
    return None


def train_in_own_process(args: argparse.Namespace, model_name: str, names: str | None) -> dict:
    """`train` in a fresh Python process (this script with ``--run``); its result as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "run.json")
        cmd = [sys.executable, os.path.abspath(__file__), *args.argv, "--model", model_name,
               "--run", "offload" if names else "plain", "--result", result]
        if names:
            cmd += ["--offload-modules", names]
        done = subprocess.run(cmd)
        if done.returncode != 0:
            raise SystemExit(f"hf_finetune: the {'offload' if names else 'plain'} run of {model_name} failed "
                             f"(exit {done.returncode}): {shlex.join(cmd)}")
        with open(result) as f:
            return json.load(f)


def report(model_name: str, names: str, plain: dict, off: dict, args: argparse.Namespace) -> bool:
    rank0 = not (torch.distributed.is_initialized() and torch.distributed.get_rank())
    diff = compare(plain, off)
    if rank0:
        steady = lambda r: statistics.median(r["ms"][1:] or r["ms"])  # noqa: E731
        print(f"\n{model_name} ({args.size}, {plain['params'] / 1e6:.1f}M parameters), batch {args.batch} x seq "
              f"{args.seq}, {args.attn}, {args.device} {str(args.dtype).removeprefix('torch.')}"
              f"{setup(args)}; offloaded names: {run_names(names, off, args)}")
        print(f"{'run':<10}{'peak MiB':>10}{'step ms':>10}{'offloaded MiB/step':>20}")
        for label, r in (("plain", plain), ("offload", off)):
            peak = f"{r['peak']:.0f}" if r["peak"] is not None else "n/a"
            moved = f"{r['offloaded'][-1] / 2**20:.2f}" if r["offloaded"] else "-"
            print(f"{label:<10}{peak:>10}{steady(r):>10.1f}{moved:>20}")
        if plain["peak"] is not None:
            saved, slower = plain["peak"] - off["peak"], steady(off) / steady(plain) - 1
            print(f"memory saved: {saved:.0f} MiB; step time {slower:+.1%}")
            if off.get("left_over_mib", 0) >= 1:
                print(f"note: {off['left_over_mib']:.0f} MiB of the first run were still allocated during the "
                      "second (its peak includes them)")
        else:
            print("peak memory: n/a on the CPU (the CPU fallback runs the engine but saves nothing)")
        print(f"losses and weights bitwise equal: {diff is None}" + (f" ({diff})" if diff else ""))
    if args.json and rank0:
        write_record(args.json, model_name, names, plain, off, diff is None, args)
    return diff is None


def write_record(path: str, model_name: str, names: str, plain: dict, off: dict, bitwise: bool,
                 args: argparse.Namespace) -> None:
    """Add this comparison to the JSON file ``path`` (``{"records": [...]}``, docs/results/hf.json):
    step time (median after the first step) and peak allocated bytes with and without offloading,
    and whether losses and final weights (so every step's gradients) were bitwise equal."""
    steady = lambda r: statistics.median(r["ms"][1:] or r["ms"])  # noqa: E731
    peak = lambda r: None if r["peak"] is None else int(r["peak"] * 2**20)  # noqa: E731
    record = {
        "model": f"{model_name} {args.size} ({plain['params'] / 1e6:.0f}M parameters, batch {args.batch}, "
                 f"seq {args.seq}, {args.attn}{setup(args)})",
        "names": run_names(names, off, args), "step_ms": round(steady(off), 2), "peak_bytes": peak(off),
        "baseline_step_ms": round(steady(plain), 2), "baseline_peak_bytes": peak(plain),
        "grads_bitwise": bitwise,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "command": shlex.join([*(["torchrun", "--nproc-per-node", str(world_size())] if world_size() > 1 else
                                 ["python"]), "examples/hf_finetune.py", *sys.argv[1:]]),
    }
    records = json.load(open(path))["records"] if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump({"records": [*records, record]}, f, indent=1)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["llama", "qwen3_moe", "all"], default="llama")
    p.add_argument("--size", choices=list(SIZES), default=None,
                   help="model size (default: small on CUDA, tiny on the CPU)")
    p.add_argument("--offload-modules", default=None, metavar="NAMES",
                   help=f"offload names, comma-separated (default per model: {DEFAULT_NAMES})")
    p.add_argument("--fsdp2", action="store_true", help="shard each decoder layer with FSDP2 (fully_shard)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="checkpoint every decoder layer (both runs); 'layer' offloads the inputs it keeps")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps (default: 6 on CUDA, 2 on the CPU)")
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: the size's)")
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--seq", type=positive_int, default=None)
    p.add_argument("--attn", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH", help="add each comparison as a record to this JSON file "
                   "(docs/results/hf.json's fields)")
    p.add_argument("--memory-budget", default=None, metavar="BUDGET",
                   help="let the planner choose among the names what to offload and recompute for this "
                        "budget ('20GiB', '-4GiB', '-30%%', 'fit:10%%'; docs/planner.md)")
    p.add_argument("--min-tensor-bytes", type=int, default=None,
                   help="smallest saved tensor to offload (default: the library's 1 MiB on CUDA, 0 on the CPU)")
    p.add_argument("--run", choices=["plain", "offload"], help=argparse.SUPPRESS)  # one run, in a child process
    p.add_argument("--result", help=argparse.SUPPRESS)  # where that run writes its result
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv = _without_options(argv, ("--json", "--model", "--offload-modules"))
    cuda = torch.device(args.device).type == "cuda"
    if cuda and args.fsdp2 and torch.device(args.device).index is None:  # one GPU per rank under torchrun
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    args.size = args.size or ("small" if cuda else "tiny")
    args.steps = args.steps or (6 if cuda else 2)
    args.batch = args.batch or (4 if cuda else 2)
    args.seq = args.seq or (1024 if cuda else 16)
    if args.min_tensor_bytes is None:
        args.min_tensor_bytes = offload.config.DEFAULT_MIN_TENSOR_BYTES if cuda else 0
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.gradient_checkpointing and "layer" in (args.offload_modules or "").replace(" ", ",").split(","):
        from transformers.modeling_layers import GradientCheckpointingLayer

        from offload.presets import checkpoint_wraps_hooks

        if checkpoint_wraps_hooks(GradientCheckpointingLayer):
            p.error("--offload-modules layer with --gradient-checkpointing needs transformers >= 5.23 "
                    "(before it, checkpointing runs the layer's hooks inside the checkpoint)")
    if args.memory_budget is not None:
        if args.gradient_checkpointing:
            p.error("--memory-budget chooses what to recompute itself: leave out --gradient-checkpointing")
        if args.fsdp2:
            p.error("--memory-budget plans on one unsharded model: leave out --fsdp2")
        if args.steps < 2:
            p.error("--memory-budget plans after the first step: give --steps 2 or more")
        try:
            offload.Budget.parse(args.memory_budget)
        except offload.OffloadError as exc:
            p.error(str(exc))
    return args


def _without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less the given options and their values (``--opt value`` or ``--opt=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in options)):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    in_process = args.run is not None or "RANK" in os.environ  # a child run, or torchrun's ranks
    mesh = None
    if in_process:
        if torch.device(args.device).type == "cuda":
            torch.use_deterministic_algorithms(True)  # warn_only would leave cuDNN attention non-deterministic
        mesh = start_distributed(torch.device(args.device)) if args.fsdp2 else None  # before any CUDA work
    ok = True
    for model_name in (["llama", "qwen3_moe"] if args.model == "all" else [args.model]):
        names = args.offload_modules or (PLAN_NAMES if args.memory_budget else DEFAULT_NAMES)[model_name]
        if args.run is not None:  # the child: one run, its result to the parent
            result = train(args, model_name, names if args.run == "offload" else None, mesh)
            with open(args.result, "w") as f:
                json.dump(result, f)
            continue
        if in_process:  # under torchrun: both runs in this process, the first one's memory freed first
            plain = train(args, model_name, None, mesh)
            left_over = release_memory(args)
            off = train(args, model_name, names, mesh)
            off["left_over_mib"] = left_over
        else:
            plain, off = train_in_own_process(args, model_name, None), train_in_own_process(args, model_name, names)
        ok = report(model_name, names, plain, off, args) and ok
    if in_process and mesh is not None:
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
