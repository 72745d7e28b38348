"""Bad inputs and what each gets (docs/errors.md): the rows of that table that this file checks,
and a check that every row of the table names a test that exists."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import offload
from offload import OffloadError, OffloadTypeError, OffloadValueError, notices
from offload.testing import GPT_MAPPING, build_gpt, train_step

ROOT = Path(__file__).resolve().parents[1]


def _model():
    return build_gpt(32, 4, 2)


BAD_ARGUMENTS = {
    # id: (call, error, words the message must hold)
    "configure_modules_int": (lambda m: offload.configure(3), OffloadTypeError,
                              "module names must be a string such as 'core_attn,fc1' or a list of strings, got 3"),
    "configure_module_name_int": (lambda m: offload.configure(["fc1", 3]), OffloadTypeError,
                                  "a module name must be a string, got 3 (int)"),
    "configure_bad_name": (lambda m: offload.configure("fc1,1fc"), OffloadValueError,
                           "'1fc' is not a valid module name"),
    "configure_min_tensor_bytes_negative": (lambda m: offload.configure("fc1", min_tensor_bytes=-1), OffloadValueError,
                                            "min_tensor_bytes must be >= 0, got -1"),
    "configure_min_tensor_bytes_str": (lambda m: offload.configure("fc1", min_tensor_bytes="1"), OffloadTypeError,
                                       "min_tensor_bytes must be an int, got '1' (str)"),
    "configure_max_inflight_zero": (lambda m: offload.configure("fc1", max_inflight_groups=0), OffloadValueError,
                                    "max_inflight_groups must be >= 1, got 0"),
    "configure_copy_chunk_negative": (lambda m: offload.configure("fc1", copy_chunk_bytes=-1), OffloadValueError,
                                      "copy_chunk_bytes must be >= 0"),
    "configure_max_pinned_negative": (lambda m: offload.configure("fc1", max_pinned_bytes=-1), OffloadValueError,
                                      "max_pinned_bytes (or None) must be >= 0"),
    "configure_policy_not_callable": (lambda m: offload.configure("fc1", policy=3), OffloadTypeError,
                                      "policy must be a callable"),
    "configure_device_unknown": (lambda m: offload.configure("fc1", device="gpu0"), OffloadValueError,
                                 "device must be 'cuda', 'cuda:N', 'cpu' or None, got 'gpu0'"),
    "group_name_int": (lambda m: offload.group(3), OffloadTypeError, "a group name must be a string, got 3 (int)"),
    "open_group_name_int": (lambda m: offload.get_manager().open_group(3), OffloadTypeError,
                            "a group name must be a string, got 3 (int)"),
    "attach_model_not_module": (lambda m: offload.attach("model", GPT_MAPPING), OffloadTypeError,
                                "attach() takes a torch.nn.Module, got str"),
    "attach_mapping_str": (lambda m: offload.attach(m, "layers.*.mlp"), OffloadTypeError,
                           "mapping must be a dict of group name -> module pattern(s)"),
    "attach_chunk_id_negative": (lambda m: offload.attach(m, GPT_MAPPING, chunk_id=-1), OffloadValueError,
                                 "chunk_id (the model chunk: 0, or 0..vpp-1 in a pipeline) must be >= 0, got -1"),
    "attach_chunk_id_str": (lambda m: offload.attach(m, GPT_MAPPING, chunk_id="0"), OffloadTypeError,
                            "chunk_id (the model chunk: 0, or 0..vpp-1 in a pipeline) must be an int, got '0'"),
    "attach_nested_pattern": (lambda m: offload.attach(m, {"block": "layers.*"}), OffloadValueError,
                              "pattern 'layers.*' of group 'block' matches 'layers.0' and its submodule "
                              "'layers.0.input_layernorm'"),
    "attach_nested_patterns": (lambda m: offload.attach(m, {"mlp": ["layers.*.mlp", "layers.1.mlp.linear_fc1"]}),
                               OffloadValueError, "patterns 'layers.*.mlp' and 'layers.1.mlp.linear_fc1' of group "
                                                  "'mlp' match 'layers.1.mlp' and its submodule"),
    "begin_chunk_str": (lambda m: offload.begin_chunk("abc"), OffloadTypeError,
                        "begin_chunk()'s chunk_id (the model chunk: 0, or 0..vpp-1 in a pipeline) must be an int, "
                        "got 'abc' (str)"),
    "begin_chunk_negative": (lambda m: offload.begin_chunk(-1), OffloadValueError, "chunk_id"),
    "begin_chunk_bool": (lambda m: offload.begin_chunk(True), OffloadTypeError, "got True (bool)"),
    "begin_chunk_microbatch_negative": (lambda m: offload.begin_chunk(0, -2), OffloadValueError,
                                        "begin_chunk()'s microbatch (or None to count them) must be >= 0, got -2"),
    "set_schedule_str": (lambda m: offload.set_schedule("1F1B"), OffloadTypeError,
                         "a schedule is Megatron's signed order, a list of ints"),
    "set_schedule_int": (lambda m: offload.set_schedule(5), OffloadTypeError, "got 5"),
    "set_schedule_entry_str": (lambda m: offload.set_schedule([1, "a", -1]), OffloadTypeError, "got [1, 'a', -1]"),
    "set_schedule_zero": (lambda m: offload.set_schedule([0]), OffloadValueError,
                          "set_schedule() got an order that is not a schedule: order[0] is 0"),
    "set_schedule_no_backward": (lambda m: offload.set_schedule([1, 1, -1]), OffloadValueError,
                                 "runs forwards without their backwards"),
    "mark_not_offload_int": (lambda m: offload.mark_not_offload(3), OffloadTypeError,
                             "mark_not_offload takes tensors, got int"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_argument_is_refused_at_once(configure, case):
    """Each call raises the `OffloadError` subclass of its row (a TypeError or ValueError too),
    naming the value, before anything changed: the engine configured before is still the one."""
    call, error, words = BAD_ARGUMENTS[case]
    manager = configure(["fc1"])
    model = _model()
    with pytest.raises(error) as info:
        call(model)
    assert isinstance(info.value, OffloadError)
    assert str(info.value).startswith("offload: ") and words in str(info.value), str(info.value)
    assert offload.get_manager() is manager and manager.declared_names == set()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_configure_cuda_without_cuda_keeps_the_engine(configure):
    manager = configure(["fc1"])
    with pytest.raises(OffloadValueError, match="asked for a CUDA device, but CUDA is not available"):
        offload.configure("fc1", device="cuda")
    assert offload.get_manager() is manager


def test_nested_pattern_names_the_outer_modules(configure):
    """The error for ``"layers.*"`` says how to match the layers alone."""
    configure(["block"])
    with pytest.raises(OffloadValueError, match=r"lie inside other matched ones.*\['layers\.\[0-9\]'\]"):
        offload.attach(_model(), {"block": "layers.*"})
    offload.attach(_model(), {"block": "layers.[0-9]"})  # the suggestion works


@pytest.mark.parametrize("second", ["same_model", "same_mapping_other_names", "parent", "child"])
def test_attach_on_an_attached_model_is_refused_until_removed(configure, second):
    configure(["fc1", "core_attn"])
    model = _model()
    handle = offload.attach(model, {"fc1": GPT_MAPPING["fc1"]})
    again = {
        "same_model": lambda: offload.attach(model, {"fc1": GPT_MAPPING["fc1"]}),
        "same_mapping_other_names": lambda: offload.attach(model, {"core_attn": GPT_MAPPING["core_attn"]}),
        "parent": lambda: offload.attach(torch.nn.Sequential(model), {"x": "0.final_layernorm"}),
        "child": lambda: offload.attach(model.layers[0], {"y": "self_attention"}),
    }[second]
    with pytest.raises(OffloadError, match=r"is already attached \(.*by an earlier attach\(\)\); call remove\(\)"):
        again()
    handle.remove()
    again()  # removed: attaching again is fine


@pytest.mark.parametrize("where", ["around", "after"])
def test_attach_does_not_raise_for_a_code_group_name(configure, where):
    """A configured name that is not attached and close to none that is: no warning at attach (a
    group in the code may open it), and no error once that group ran, around the model or after
    its forward (a loss head: the check waits for the gradient to reach the model's output)."""
    configure(["fc1", "mine"])
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.attach(model, {"fc1": GPT_MAPPING["fc1"]})
    x = torch.randn(8, 2, 32, requires_grad=True)
    for _ in range(2):
        if where == "around":
            with offload.group("mine", x) as x1:
                loss = model(x1 * 2).sum()
        else:
            out = model(x)
            with offload.group("mine", out) as o:
                loss = (o * o).sum()
        loss.backward()
        assert offload.end_iteration().by_name["fc1"].groups == 2


def _notes_of_two_iterations(model) -> tuple[list[list[str]], list]:
    """Attach ``model`` (a `build_gpt` stack of hidden 32) and train two steps; returns the
    `RuntimeWarning`s said at each iteration's end and each iteration's statistics."""
    offload.attach(model, GPT_MAPPING)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    notes, stats = [], []
    for _ in range(2):
        train_step(model, x, g)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            stats.append(offload.end_iteration())
        notes.append([str(w.message) for w in said if issubclass(w.category, RuntimeWarning)])
    return notes, stats


@pytest.mark.parametrize("case", ["no_names", "below_min", "kept"])
def test_first_iteration_says_why_nothing_was_offloaded(configure, case):
    """Nothing offloaded in the first iteration: one warning with the numbers at its end, none
    at the next. Before: nothing was said."""
    kw = {"below_min": {"min_tensor_bytes": 1 << 30}}.get(case, {})
    configure([] if case == "no_names" else ["core_attn", "fc1"], **kw)
    notes, _ = _notes_of_two_iterations(build_gpt(32, 4, 1 if case == "kept" else 2))
    assert notes[1] == []
    [note] = notes[0]
    assert note.startswith("offload: nothing was offloaded in the first iteration: ")
    expected = {
        "no_names": "no module name is configured (group names of the model: attn_norm, attn_proj, core_attn, "
                    "fc1, fc2, mlp_act, mlp_norm, qkv_linear); call offload.configure(modules=...)",
        "below_min": "4 group(s) of core_attn, fc1 ran; 14 saved tensor(s) of them (storages of 78336 bytes in all) were under "
                     "min_tensor_bytes=1073741824: lower it to offload them",
        "kept": "2 group(s) of core_attn, fc1 ran; 2 group(s) stayed on the device as the last of their name",
    }[case]
    assert expected in note, note


def test_a_name_whose_saved_tensors_are_all_held_elsewhere_is_named_once(configure, monkeypatch):
    """attn_proj saves only core_attn's output, which core_attn's attention (not offloaded)
    saves too: copying it would free nothing, so it stays. While fc1 copies, one warning names
    attn_proj with its bytes at the end of the first iteration, none later. Before: only the
    statistics' ``bytes_held_elsewhere`` said so."""
    monkeypatch.setattr(notices, "_said", set())  # as in a fresh process
    configure(["attn_proj", "fc1"])
    notes, stats = _notes_of_two_iterations(build_gpt(32, 4, 3))
    assert all(s.by_name["fc1"].bytes_offloaded > 0 for s in stats)
    stats = stats[-1]
    held = stats.by_name["attn_proj"].bytes_held_elsewhere
    assert held == 2 * 8 * 2 * 32 * 4 and stats.by_name["attn_proj"].bytes_offloaded == 0
    assert notes == [[
        f"offload: 'attn_proj' copied nothing in iteration 0: the {held} bytes its 3 group(s) saved were all "
        "held by something else as well (saved by a module that is not offloaded, or a CUDA graph's output), "
        "so copying them would free no device memory. Offload what holds them, or drop 'attn_proj' from the "
        "names."], []]


def test_misspelled_name_in_a_pipeline_waits_for_every_attached_chunk(configure):
    """Two chunks attached: the names are checked when both have run a forward, so a name that
    only the second chunk's code opens is no error after the first chunk."""
    configure(["fc1", "mine"])
    chunks = [_model(), _model()]
    offload.attach(chunks[0], {"fc1": GPT_MAPPING["fc1"]}, chunk_id=0)
    offload.attach(chunks[1], {}, chunk_id=1)
    x = torch.randn(8, 2, 32, requires_grad=True)
    h = chunks[0](x)
    with offload.group("mine", h) as h1:
        out = chunks[1](h1)
    out.sum().backward()
    offload.end_iteration()


# ---------------------------------------------------------------- scripts and tools
def _console_scripts() -> dict[str, str]:
    """pyproject.toml's ``[project.scripts]``: name -> ``module:function``."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text[text.index("[project.scripts]"):].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', table, re.M))


@pytest.mark.parametrize("script", sorted(_console_scripts()))
def test_console_script_help_lists_its_options(script, capsys):
    """``offload-X --help`` exits 0 with argparse's usage and options (offload-overlap printed
    its docstring and exited 2)."""
    module, _, func = _console_scripts()[script].partition(":")
    main = getattr(__import__(module, fromlist=[func]), func)
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: ") and "-h, --help" in out


def test_overlap_without_a_command_says_which(capsys):
    from offload.tools import overlap

    with pytest.raises(SystemExit) as info:
        overlap.main([])
    assert info.value.code == 2 and "{record,report,kernels}" in capsys.readouterr().err


CUDA_ONLY_SCRIPTS = {
    "memory_timeline": ("tools/memory_timeline.py", []),
    "peers": ("benchmarks/peers.py", ["--sizes", "gpt-l", "--no-sweep", "--out", "out"]),
    "bench_layer_stack": ("benchmarks/bench_layer_stack.py", ["--out", "out"]),
    "graph_pool_trace": ("benchmarks/graph_pool_trace.py", []),
    "graphs": ("benchmarks/graphs.py", ["--out", "out"]),
    "copy_issue": ("benchmarks/copy_issue.py", []),
    "sync_latency": ("benchmarks/sync_latency.py", []),
    "host_under_copies": ("benchmarks/host_under_copies.py", ["--json", "out/h.json"]),
    "offload.tools.bandwidth": ("offload/tools/bandwidth.py", []),
    "offload.tools.memory": ("offload/tools/memory.py", ["--modules", "core_attn", "--device", "cuda"]),
    "profile_step": ("tools/profile_step.py", ["--out", "out", "--", "examples/megatron_gpt.py"]),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("case", list(CUDA_ONLY_SCRIPTS))
def test_cuda_only_script_says_it_needs_cuda(case, tmp_path, monkeypatch, capsys):
    """Run without CUDA, each script exits non-zero with a sentence naming CUDA, before it writes
    anything (not with torch's AssertionError). Run in this process, as ``python SCRIPT``."""
    path, argv = CUDA_ONLY_SCRIPTS[case]
    monkeypatch.chdir(tmp_path)  # the relative --out "out" lands here, if anything is written
    monkeypatch.setattr(sys, "argv", [path, *argv])
    if path.startswith("offload/"):
        run = lambda: runpy.run_module(case, run_name="__main__")  # noqa: E731
    else:
        run = lambda: runpy.run_path(str(ROOT / path), run_name="__main__")  # noqa: E731
    with pytest.raises(SystemExit) as info:
        run()
    message = f"{info.value.code} {capsys.readouterr().err}"
    assert info.value.code not in (0, None) and "CUDA" in message, message
    assert list(tmp_path.iterdir()) == []


def test_peers_exits_non_zero_when_a_job_fails(tmp_path):
    """Jobs that fail (here: killed at once by --worker-timeout-s) make the run exit 1 and say
    which; it printed "N job(s) failed" and exited 0."""
    cmd = [sys.executable, "benchmarks/peers.py", "--smoke", "--sizes", "gpt-s", "--configs", "offload:attn",
           "--no-sweep", "--worker-timeout-s", "0.01", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "2 job(s) of this run failed" in run.stderr and "gpt-s__offload-attn" in run.stderr


# ---------------------------------------------------------------- the table
def test_every_row_of_docs_errors_md_names_a_test_that_exists():
    """Each row of docs/errors.md's tables of bad inputs cites at least one test, and each cited
    test (and parameter id) is defined."""
    rows, in_table = [], False
    for line in (ROOT / "docs" / "errors.md").read_text().splitlines():
        if line.startswith("| bad input"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            rows.append(line)
    assert len(rows) > 30
    for row in rows:
        cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([\w\-]+)\])?`", row)
        assert cited, f"no test cited in: {row}"
        for path, name, param in cited:
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"
            if param:
                assert re.search(rf"\b{re.escape(param)}\b", source), f"{path}::{name}[{param}] does not exist"
