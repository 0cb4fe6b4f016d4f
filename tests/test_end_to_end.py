"""Real AOTInductor compiles, saved, loaded in a fresh process, compared with eager PyTorch."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import pytest
import torch
from torch.fx.passes.utils.fuser_utils import validate_partition

import aotstack
from aotstack import CompileSpec
from aotstack.engine import processor
from aotstack.format.ops import is_delegate_call
from tests import custom_ops_lib, models
from tests.conftest import assert_matches_eager, run_in_fresh_process


@pytest.mark.parametrize("name", ["add", "conv", "linear"])
def test_fully_supported_model_is_one_delegate_and_matches_eager(lowered_package, name):
    lowered, path = lowered_package(name)

    [delegate] = lowered.delegates("forward")
    assert delegate.backend_id == "aoti_cpu"
    assert delegate.target_device == "cpu"
    assert delegate.ops, "a delegate lists the ATen ops it runs"
    calls = [n for n in lowered.methods["forward"].graph.nodes if n.op == "call_function"]
    assert sum(is_delegate_call(n) for n in calls) == 1
    assert all(is_delegate_call(n) or n.target.__name__ == "getitem" for n in calls)
    assert_matches_eager(run_in_fresh_process(path, "forward", name), name)


def test_excluded_op_between_supported_ops_splits_into_convex_partitions():
    program = aotstack.export(models.build("split"), {"forward": models.example_inputs("split")})
    exported = program.methods["forward"]
    result = aotstack.AotiCpuPartitioner(exclude_ops=["aten.sigmoid"]).partition(exported)

    partitions: dict[str, list[torch.fx.Node]] = {}
    for node in exported.graph.nodes:
        if node.op == "call_function" and "delegation_tag" in node.meta:
            partitions.setdefault(node.meta["delegation_tag"], []).append(node)
    assert set(partitions) == set(result.partition_tags)
    assert len(partitions) >= 2
    for nodes in partitions.values():
        assert validate_partition(nodes)
    sigmoid = [n for n in exported.graph.nodes if n.target == torch.ops.aten.sigmoid.default]
    assert sigmoid and "delegation_tag" not in sigmoid[0].meta


def test_split_model_runs_sigmoid_as_plain_aten_and_matches_eager(lowered_package):
    lowered, path = lowered_package("split", exclude_ops=("aten.sigmoid",))

    delegates = lowered.delegates("forward")
    assert len(delegates) >= 2
    assert all("aten.sigmoid.default" not in d.ops for d in delegates)
    plain = [n.target for n in lowered.methods["forward"].graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.sigmoid.default in plain
    assert_matches_eager(run_in_fresh_process(path, "forward", "split"), "split")


def test_two_methods_store_shared_weights_once(lowered_package):
    _, both = lowered_package("shared", methods=("forward", "score"))
    _, forward_only = lowered_package("shared", methods=("forward",))
    _, score_only = lowered_package("shared", methods=("score",))
    encoder = models.build("shared").encoder
    shared_bytes = (encoder.weight.numel() + encoder.bias.numel()) * 4

    saved = os.path.getsize(forward_only) + os.path.getsize(score_only) - os.path.getsize(both)
    assert shared_bytes * 0.95 <= saved <= shared_bytes * 1.05
    for method in ("forward", "score"):
        assert_matches_eager(run_in_fresh_process(both, method, "shared"), "shared", method)


def test_unused_parameter_and_buffer_lower_save_and_load(lowered_package):
    lowered, path = lowered_package("unused")

    assert len(lowered.delegates("forward")) == 1
    assert_matches_eager(run_in_fresh_process(path, "forward", "unused"), "unused")


def test_loaded_methods_are_callable_by_name_and_as_attributes(lowered_package):
    _, path = lowered_package("shared", methods=("forward", "score"))
    loaded = aotstack.load(path)
    x = models.example_inputs("shared")[0]

    assert loaded.method_names == ["forward", "score"]
    torch.testing.assert_close(loaded.score(x), loaded.run("score", x))
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward(x), models.build("shared")(x), rtol=1e-5, atol=1e-5)


def test_lowering_leaves_the_users_program_untouched(lowered_package):
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    before = str(program.methods["forward"].graph)

    aotstack.lower(program, [aotstack.AotiCpuPartitioner()])

    assert str(program.methods["forward"].graph) == before


def test_dynamic_batch_and_an_input_named_like_a_builtin(tmp_path):
    # nn.Sequential names its argument ``input``, which torch renames when it copies a graph.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = aotstack.export(
        model, {"forward": (torch.randn(4, 16),)}, dynamic_shapes={"forward": {"input": {0: batch}}}
    )
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner(exclude_ops=["aten.relu"])])
    lowered.save(tmp_path / "dynamic.pt2")
    loaded = aotstack.load(tmp_path / "dynamic.pt2")

    assert lowered.delegates("forward")[0].inputs[0].shape == [None, 16]
    with torch.no_grad():
        for rows in (1, 7, 33):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(loaded.forward(x), model(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(aotstack.InputError, match=r"'input' has shape \[3, 15\], expected \[s\d+ in \[1, 64\], 16\]"):
        loaded.forward(torch.randn(3, 15))


class PatchesOfKeptImages(torch.nn.Module):
    """The images left after dropping all-zero ones (padding), cut into patches by a strided convolution and read
    as a sequence: SmolVLM's and Idefics 3's vision embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 32, kernel_size=8, stride=8)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        kept = images[images.flatten(1).abs().sum(1) > 0]
        return self.patches(kept).flatten(2).transpose(1, 2)


def test_a_convolution_of_a_data_dependent_count_of_images_matches_eager(tmp_path):
    # Inductor made the convolution channels-last on a CPU without converting this input, and the code after it
    # read the convolution's output as channels-last: 2.2 off.
    torch.manual_seed(0)
    model = PatchesOfKeptImages().eval()
    program = aotstack.export(model, {"forward": (torch.randn(2, 3, 32, 32),)})
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()], progress=False).save(tmp_path / "patches.pt2")
    loaded = aotstack.load(tmp_path / "patches.pt2")

    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward(images), model(images))
        images[0] = 0
        torch.testing.assert_close(loaded.forward(images), model(images))


class RelativeWindow(torch.nn.Module):
    """Scores each position against a window of relative embeddings, padded out or sliced to the length, as VITS's
    attention does: the slice starts at ``max(window + 1 - length, 0)``, 0 for a length past the window."""

    window = 4

    def __init__(self) -> None:
        super().__init__()
        self.relative = torch.nn.Parameter(torch.randn(1, 2 * self.window + 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        pad = max(length - (self.window + 1), 0)
        relative = torch.nn.functional.pad(self.relative, [0, 0, pad, pad, 0, 0])
        start = max(self.window + 1 - length, 0)
        return torch.softmax(x @ relative[:, start:start + 2 * length - 1].transpose(-2, -1), -1)


def test_a_slice_that_starts_by_the_length_matches_eager_below_the_traced_length(tmp_path):
    # Decomposing the export retraced it, evaluating its guard that the slice is in bounds by the traced length:
    # its shape environment took the length to be at least 6, Inductor compiled the slice's start as 0, and the
    # file's range let a length of 3 in (0.9 off). Plain AOTInductor on torch.export's program was right.
    torch.manual_seed(0)
    model = RelativeWindow().eval()
    length = torch.export.Dim.DYNAMIC
    program = aotstack.export(model, {"forward": (torch.randn(2, 8, 8),)},
                              dynamic_shapes={"forward": ({1: length},)})
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()], progress=False).save(tmp_path / "window.pt2")
    loaded = aotstack.load(tmp_path / "window.pt2")

    with torch.no_grad():
        for tokens in (8, 5, 3, 2):
            x = torch.randn(2, tokens, 8)
            torch.testing.assert_close(loaded.forward(x), model(x))


def test_a_program_decomposed_before_lowering_refuses_the_sizes_its_shapes_no_longer_hold_for(tmp_path):
    # torch's own run_decompositions narrows the length to at least 6 in the program's shape environment, not in
    # its range_constraints: below 6 the file would compute the slice wrongly, so it refuses.
    torch.manual_seed(0)
    model = RelativeWindow().eval()
    with torch.no_grad():
        exported = torch.export.export(model, (torch.randn(2, 8, 8),),
                                       dynamic_shapes=({1: torch.export.Dim.DYNAMIC},)).run_decompositions()
    declared = dict(exported.range_constraints)
    with pytest.warns(UserWarning, match=r"method 'forward': size s\d+ was declared in \[2, int_oo\] but the "
                                         r"program's shapes hold for \[6, int_oo\] only"):
        program = aotstack.Program({"forward": exported})
    assert exported.range_constraints == declared, "the caller's program is left as it was"
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()], progress=False).save(tmp_path / "window.pt2")
    loaded = aotstack.load(tmp_path / "window.pt2")

    with torch.no_grad():
        for tokens in (8, 6):
            x = torch.randn(2, tokens, 8)
            torch.testing.assert_close(loaded.forward(x), model(x))
        with pytest.raises(aotstack.InputError, match=r"'x' dimension 1 is 5, outside the range \[6, ∞\]"):
            loaded.forward(torch.randn(2, 5, 8))


def test_compiled_code_refuses_a_size_that_breaks_a_guard_of_its_export_rather_than_computing_it(tmp_path):
    # AOTInductor's code does not check torch.export's guards: it read 6 rows as one run of four and returned it,
    # where eager raises. The file checks them before the library runs.
    model = models.build("rows_of_four")
    program = aotstack.export(model, {"forward": models.example_inputs("rows_of_four")},
                              dynamic_shapes={"forward": ({0: torch.export.Dim.DYNAMIC},)})
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()], progress=False)
    assert [d.backend_id for d in lowered.delegates("forward")] == ["aoti_cpu"]
    lowered.save(tmp_path / "fours.pt2")
    loaded = aotstack.load(tmp_path / "fours.pt2")

    for rows in (8, 12):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(loaded.forward(x), model(x))
    with pytest.raises(aotstack.InputError, match=r"argument 'x' dimension 0 is 6 \(s\d+\), but the method was "
                                                  r"exported for sizes where .*// 4"):
        loaded.forward(torch.randn(6, 3))


class FloorOfPositives(torch.nn.Module):
    """Makes a tensor as it runs, in a submodule (GPT-Neo's and Falcon's attention make their mask value so)."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        return torch.where(h > 0, h, torch.tensor(torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device))


class MethodsOverALayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(FloorOfPositives())

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).amax(dim=0)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * 2


@pytest.mark.parametrize("strict", [True, False])
def test_a_tensor_a_submodule_makes_in_a_named_method_is_kept_by_the_program(tmp_path, strict):
    model, x = MethodsOverALayer().eval(), torch.randn(4, 8)
    program = aotstack.export(model, {"prefill": (x,), "decode": (x,)}, strict=strict)
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner(exclude_ops=["aten.where"])])
    lowered.save(tmp_path / "made.pt2")
    loaded = aotstack.load(tmp_path / "made.pt2")
    with torch.no_grad():
        torch.testing.assert_close(loaded.prefill(x), model.prefill(x))
        torch.testing.assert_close(loaded.decode(x), model.decode(x))


@pytest.mark.skipif(not processor.capabilities(), reason="torch cannot tell this CPU's features")
def test_a_cpu_library_records_the_instructions_it_needs_and_a_cpu_without_them_is_refused(lowered_package, tmp_path):
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    lowered, _ = lowered_package("linear")
    [delegate] = lowered.delegates("forward")
    needed = json.loads(delegate.processed_bytes)["cpu_features"]
    vector_code = processor.features_of_flags(pick_vec_isa().build_arch_flags().split())
    assert set(vector_code) <= set(needed) <= processor.cpu_features()
    assert processor.missing_features(needed) == []

    # The same file, as compiled on a machine with one more instruction set than this one.
    processed = json.loads(delegate.processed_bytes)
    processed["cpu_features"] = [*needed, "avx_from_the_future"]
    foreign = dataclasses.replace(lowered, delegate_table={
        "forward": [dataclasses.replace(delegate, processed_bytes=json.dumps(processed).encode())]
    })
    foreign.save(tmp_path / "foreign.pt2")
    with pytest.raises(aotstack.DelegateInitError, match=r"method 'forward'.*lacks \(avx_from_the_future\)"):
        aotstack.load(tmp_path / "foreign.pt2")


def test_caches_key_what_was_compiled_and_measured_by_the_processor(monkeypatch):
    from aotstack.backends.aoti import compile as aoti_compile
    from aotstack.compile import auto, cache
    from aotstack.compile.program_parts import program_structure

    exported = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")}).methods["forward"]
    # An engine whose compiled partitions aotstack caches (AOTInductor's libraries have a cache of their own).
    backend = pytest.importorskip("aotstack.backends.ort.backend").OrtBackend()
    assert cache.preprocess_key(backend, exported, []) is not None

    def keys() -> tuple[str, ...]:
        return (aoti_compile.cache_key(program_structure(exported), {}), cache.preprocess_key(backend, exported, []),
                auto.measurement_key("program", auto.TimingInputs((tuple(exported.example_inputs[0]), {}), given=False),
                                     ("aoti_cpu",), 1))

    here = keys()
    for module in (aoti_compile, cache, auto):
        monkeypatch.setattr(module, "processor_fingerprint", lambda: "another processor")
    elsewhere = keys()
    assert all(a != b for a, b in zip(here, elsewhere, strict=True))


class Doubled(torch.nn.Module):
    """Doubles, then passes the result through an op that notes torch's thread count while the library runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aotstack_custom.threads_seen(torch.relu(x) * 2)


def openmp_symbols(library: str) -> list[str]:
    listed = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in listed.stdout.splitlines()]
    return [name for name in names if name.startswith(("GOMP_", "omp_"))]


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm to list a library's symbols")
def test_a_library_compiled_for_one_thread_runs_on_one_thread(tmp_path, monkeypatch):
    """Compiled at two threads, the code of a large elementwise op runs OpenMP parallel regions; with the threads
    spec at 1, none, the ATen and custom ops it calls run with torch's count at 1 (back to 2 after), and the numbers
    are the same."""
    x = torch.randn(512, 1024)
    program = aotstack.export(Doubled(), {"forward": (x,)})
    symbols, results, seen = {}, {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, specs in (("default", []), ("one", [CompileSpec("threads", b"1")])):
            monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / name))
            lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner(compile_specs=specs)], progress=False)
            [library] = (tmp_path / name).glob("*.so")
            symbols[name] = openmp_symbols(str(library))
            lowered.save(tmp_path / f"{name}.pt2")
            custom_ops_lib.THREADS_SEEN.clear()
            results[name] = aotstack.load(tmp_path / f"{name}.pt2").forward(x)
            seen[name] = [*custom_ops_lib.THREADS_SEEN, torch.get_num_threads()]
    finally:
        torch.set_num_threads(threads)

    assert any(symbol.startswith("GOMP_parallel") for symbol in symbols["default"]), symbols
    assert symbols["one"] == []
    assert seen == {"default": [2, 2], "one": [1, 2]}
    torch.testing.assert_close(results["one"], torch.relu(x) * 2)
    torch.testing.assert_close(results["default"], torch.relu(x) * 2)
