"""Run a training command under ``nsys profile``, export SQLite, and print the overlap report.

    python -m offload.tools.nsys_run --out prof/ -- python train.py --offload-modules=core_attn
    python -m offload.tools.nsys_run --dry-run --out prof/ -- python train.py    # print the commands

The options: CUDA and NVTX tracing (the engine's ranges are in the NVTX domain ``offload``),
no CPU sampling and no context-switch tracing (they add overhead and nothing the report uses),
``--capture-range=cudaProfilerApi`` when ``--capture`` is given (then call
``torch.cuda.profiler.start()``/``stop()`` around the steps to keep), and the SQLite export
that `offload.tools.overlap` reads. The report then runs on ``<out>/<name>.sqlite``; the
``.nsys-rep`` opens in the Nsight Systems GUI.

nsys must be installed (``--nsys`` to point at it). On the lent H100 machine nsys exists but
could not produce reports (it leaves a ``.qdstrm`` capture and no ``.nsys-rep``): then this
tool says so, gives the capture's path and exits with 0; record with ``python -m
offload.tools.overlap record`` instead (torch.profiler; same report).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path


def nsys_commands(nsys: str, out: Path, name: str, command: list[str], capture: bool) -> list[list[str]]:
    """The ``nsys profile`` command, then the export (the profile's own ``--export`` can be
    skipped silently by older versions, so the export runs on its own)."""
    if not command:
        raise ValueError("no command to profile (put it after --)")
    rep = out / name
    profile = [nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
               "--force-overwrite=true", f"--output={rep}"]
    if capture:
        profile += ["--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    export = [nsys, "export", "--type=sqlite", "--force-overwrite=true", f"--output={rep}.sqlite", f"{rep}.nsys-rep"]
    return [profile + command, export]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        k = argv.index("--")
        argv, command = argv[:k], argv[k + 1:]
    else:
        command = []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s [options] -- COMMAND ...")
    p.add_argument("--out", default="nsys", help="folder for the report, the SQLite export and the overlap report")
    p.add_argument("--name", default="profile")
    p.add_argument("--nsys", default=None, help="the nsys executable (default: nsys on PATH)")
    p.add_argument("--capture", action="store_true", help="record only between cudaProfilerStart/Stop")
    p.add_argument("--png", action="store_true", help="also draw one layer's timeline")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if not command:
        p.error("give the training command after --")
    nsys = args.nsys or shutil.which("nsys") or "nsys"
    out = Path(args.out)
    cmds = nsys_commands(nsys, out, args.name, command, args.capture)
    sqlite = out / f"{args.name}.sqlite"
    report = [sys.executable, "-m", "offload.tools.overlap", "report", str(sqlite),
              "--json", str(out / "overlap.json")] + (["--png", str(out / "timeline.png")] if args.png else [])
    if args.dry_run:
        for c in cmds + [report]:
            print(shlex.join(c))
        return 0
    if shutil.which(nsys) is None and not Path(nsys).is_file():
        p.error(f"nsys not found ({nsys}); install Nsight Systems or pass --nsys, or use "
                "'python -m offload.tools.overlap record' (torch.profiler) instead")
    out.mkdir(parents=True, exist_ok=True)
    profile_cmd, export_cmd = cmds
    rep = out / f"{args.name}.nsys-rep"
    for stale in [rep, sqlite, *out.glob(f"{args.name}*.qdstrm")]:
        stale.unlink(missing_ok=True)  # so that what is found below is this run's
    print("+ " + shlex.join(profile_cmd), file=sys.stderr)
    rc = subprocess.call(profile_cmd)
    if not rep.is_file():
        return no_report(out, args.name, rc)
    if rc != 0:
        print(f"nsys profile exited with status {rc} (the profiled command's, or nsys's own); "
              f"a report was written, going on with {rep}", file=sys.stderr)
    print("+ " + shlex.join(export_cmd), file=sys.stderr)
    rc = subprocess.call(export_cmd)
    if rc != 0 or not sqlite.is_file():
        print(f"nsys export failed (exit status {rc}) and wrote no {sqlite}; the report {rep} opens in the "
              "Nsight Systems GUI", file=sys.stderr)
        return rc or 1
    print("+ " + shlex.join(report), file=sys.stderr)
    return subprocess.call(report)


def no_report(out: Path, name: str, rc: int) -> int:
    """nsys profile wrote no ``.nsys-rep``. Where it left its raw capture (``.qdstrm``: the
    collection ran, the conversion into a report failed, as on the lent H100 machine), say so
    and where the capture is, and return 0: nothing is wrong with the training command, this
    nsys cannot make reports here. Without a capture, nsys did not run: return its status."""
    qdstrm = sorted(out.glob(f"{name}*.qdstrm")) or sorted(out.glob("*.qdstrm"))
    if qdstrm:
        print(f"nsys could not produce a report on this machine: nsys profile exited with status {rc} and wrote "
              f"no {out / (name + '.nsys-rep')}; it left its raw capture in {', '.join(map(str, qdstrm))} "
              "(QdstrmImporter, next to the nsys executable, converts it into a .nsys-rep where it works). "
              "No overlap report from nsys: use 'python -m offload.tools.overlap record' (torch.profiler) "
              "instead.", file=sys.stderr)
        print(f"nsys: no report (raw capture: {qdstrm[0]})")
        return 0
    print(f"nsys profile exited with status {rc} and wrote neither {out / (name + '.nsys-rep')} nor a .qdstrm "
          "capture: nsys did not run the command", file=sys.stderr)
    return rc or 1


if __name__ == "__main__":
    sys.exit(main())
