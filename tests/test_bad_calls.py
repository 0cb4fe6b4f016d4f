"""Calls that cannot crash: every bad call is an ``InputError``, at the method and again at each delegate.

A thousand seeded random bad calls run against an AOTInductor package and a stacked ONNX Runtime
and AOTInductor package, both with a dynamic size that two inputs share, in a child process (a
crash fails the test instead of ending pytest). Calls that look odd but are fine (negated views,
transposed or expanded inputs, subclasses that hold a plain tensor) run among them and must match
eager PyTorch. The delegates' own checks (``format/boundary.py``) are tested directly too, with
the method's checks loosened as a tampered manifest would loosen them.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

import aotstack
from aotstack.backends.aoti import run as aoti_run
from aotstack.backends.ort import run as ort_run
from aotstack.format.boundary import Boundary, BoundaryInput
from aotstack.format.manifest import InputRecord
from aotstack.format.specs import CompileSpec, SpecKey
from aotstack.runtime.inputs import InputCheck
from aotstack.runtime.load import Method
from tests.conftest import run_child

# The shared dynamic size: x and y are [n, 8] with n in [MIN_N, MAX_N].
MIN_N, MAX_N = 2, 32
BAD_CALLS = 1000


class BadCallModel(torch.nn.Module):
    """Two inputs sharing a dynamic size; ``cat`` makes a delegate input of size 2*n."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.linear(x)) + y
        doubled = torch.cat([hidden, hidden * 3]).sigmoid()
        return doubled.reshape(2, -1, 8).sum(0) + x


class PlainSubclass(torch.Tensor):
    """A subclass that only adds a method: it holds an ordinary tensor, so a call takes it."""

    def describe(self) -> str:
        return "plain"


def build_model() -> BadCallModel:
    torch.manual_seed(0)
    return BadCallModel().eval()


PARTITIONINGS: dict[str, Callable[[], list[aotstack.Partitioner]]] = {
    # Two AOTInductor delegates: the second takes cat's [2*n, 8] and x's [n, 8].
    "aoti": lambda: [aotstack.AotiCpuPartitioner(exclude_ops=["aten.cat"])],
    # AOTInductor, then ONNX Runtime for cat and sigmoid between two AOTInductor delegates.
    "stacked": lambda: [
        aotstack.AotiCpuPartitioner(exclude_ops=["aten.cat", "aten.sigmoid"]),
        aotstack.OrtPartitioner(),
    ],
}


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each partitioning of ``BadCallModel``, lowered once for the module and saved."""
    directory = tmp_path_factory.mktemp("bad-calls")
    n = Dim("n", min=MIN_N, max=MAX_N)
    program = aotstack.export(
        build_model(), {"forward": (torch.randn(4, 8), torch.randn(4, 8))},
        dynamic_shapes={"forward": {"x": {0: n}, "y": {0: n}}},
    )
    paths = {}
    for name, partitioners in PARTITIONINGS.items():
        lowered = aotstack.lower(program, partitioners())
        backends = [d.backend_id for d in lowered.delegates("forward")]
        assert backends == (["aoti_cpu"] * 2 if name == "aoti" else ["aoti_cpu", "aoti_cpu", "onnxruntime"]), backends
        paths[name] = directory / f"{name}.pt2"
        lowered.save(paths[name])
    return paths


def refused(message: str) -> Any:
    """Expect an ``InputError`` whose message matches ``message``."""
    return pytest.raises(aotstack.InputError, match=message)


# Random calls ------------------------------------------------------------------------------------

Call = tuple[tuple[Any, ...], dict[str, Any]]


def pair(rng: random.Random, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n = rng.randint(MIN_N, MAX_N) if n is None else n
    return torch.randn(n, 8), torch.randn(n, 8)


def one_replaced(rng: random.Random, make: Callable[[torch.Tensor], Any]) -> Call:
    """A good pair with one of the two arguments, at random, replaced by ``make(it)``."""
    args = list(pair(rng))
    which = rng.randrange(2)
    args[which] = make(args[which])
    return tuple(args), {}


def wrong_count(rng: random.Random) -> Call:
    x, y = pair(rng)
    return rng.choice([(), (x,), (x, y, x), (x, y, y, y)]), {}


def wrong_dtype(rng: random.Random) -> Call:
    dtype = rng.choice([torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
                        torch.uint8, torch.complex64])
    return one_replaced(rng, lambda t: t.to(dtype))


def wrong_rank(rng: random.Random) -> Call:
    n = rng.randint(MIN_N, MAX_N)
    shape = rng.choice([(n,), (n, 8, 1), (), (1, n, 8), (n * 8,)])
    return one_replaced(rng, lambda t: torch.randn(shape))


def wrong_static_size(rng: random.Random) -> Call:
    n = rng.randint(MIN_N, MAX_N)
    width = rng.choice([0, 1, 7, 9, 16, 64])
    return one_replaced(rng, lambda t: torch.randn(n, width) if rng.random() < 0.5 else torch.randn(t.shape[0], width))


def symbolic_out_of_range(rng: random.Random) -> Call:
    return pair(rng, rng.choice([0, 1, MAX_N + 1, MAX_N + 2, 100, 1000])), {}


def mismatched_shared_symbol(rng: random.Random) -> Call:
    n, m = rng.sample(range(MIN_N, MAX_N + 1), 2)
    return (torch.randn(n, 8), torch.randn(m, 8)), {}


def meta_tensor(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: t.to("meta"))


def sparse(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: t.to_sparse() if rng.random() < 0.5 else t.to_sparse_csr())


def mkldnn(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: t.to_mkldnn())


def nested_tensor(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: torch.nested.nested_tensor([t, t[:1]]))


def fake_tensor(rng: random.Random) -> Call:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return one_replaced(rng, lambda t: FakeTensorMode().from_tensor(t))


def unknown_keyword(rng: random.Random) -> Call:
    x, y = pair(rng)
    return rng.choice([
        ((x, y), {"extra": x}),
        ((x,), {"y": y}),
        ((), {"x": x, "y": y}),
        ((x, y), {"x": x}),
        ((x, y), {"training": True}),
    ])


def non_tensor(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: rng.choice(
        ["a string", {"t": t}, object(), t.numpy(), t.shape, range(3), b"bytes", torch.float32]
    ))


def none(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: None)


def python_scalar(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: rng.choice([1, 2.5, True, 3 + 1j, -7]))


def nested_list(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: rng.choice([t.tolist(), [t], (t, t), [[t]], [t.tolist()]]))


BAD_KINDS: dict[str, Callable[[random.Random], Call]] = {
    "wrong_count": wrong_count,
    "wrong_dtype": wrong_dtype,
    "wrong_rank": wrong_rank,
    "wrong_static_size": wrong_static_size,
    "symbolic_out_of_range": symbolic_out_of_range,
    "mismatched_shared_symbol": mismatched_shared_symbol,
    "meta_tensor": meta_tensor,
    "sparse": sparse,
    "mkldnn": mkldnn,
    "nested_tensor": nested_tensor,
    "fake_tensor": fake_tensor,
    "unknown_keyword": unknown_keyword,
    "non_tensor": non_tensor,
    "none": none,
    "python_scalar": python_scalar,
    "nested_list": nested_list,
}


def neg_view(rng: random.Random) -> Call:
    return one_replaced(rng, torch._neg_view)


def non_contiguous(rng: random.Random) -> Call:
    n = rng.randint(MIN_N, MAX_N)
    return (torch.randn(8, n).t(), torch.randn(n, 16)[:, ::2]), {}


def expanded(rng: random.Random) -> Call:
    n = rng.randint(MIN_N, MAX_N)
    return (torch.randn(1, 8).expand(n, 8), torch.randn(n, 1).expand(n, 8)), {}


def requires_grad(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: t.requires_grad_())


def plain_subclass(rng: random.Random) -> Call:
    return one_replaced(rng, lambda t: t.as_subclass(PlainSubclass))


def parameter(rng: random.Random) -> Call:
    return one_replaced(rng, torch.nn.Parameter)


GOOD_KINDS: dict[str, Callable[[random.Random], Call]] = {
    "neg_view (good)": neg_view,
    "non_contiguous (good)": non_contiguous,
    "expanded (good)": expanded,
    "requires_grad (good)": requires_grad,
    "plain_subclass (good)": plain_subclass,
    "parameter (good)": parameter,
}


def run_random_calls(paths: dict[str, str], seed: int, bad_calls: int) -> dict[str, Any]:
    """``bad_calls`` random bad calls spread over the packages, good ones among them; what each ended in.

    Runs in a child process: a crash there is a failed test, not a dead pytest.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    loaded = {name: aotstack.load(path) for name, path in paths.items()}
    model = build_model()
    bad = dict(BAD_KINDS)
    if not torch.backends.mkldnn.is_available():
        del bad["mkldnn"]
    counts: Counter[str] = Counter()
    failures: list[str] = []
    made = 0
    while made < bad_calls:
        package = rng.choice(sorted(loaded))
        method = loaded[package].forward
        if rng.random() < 0.2:
            kind = rng.choice(sorted(GOOD_KINDS))
            args, kwargs = GOOD_KINDS[kind](rng)
            counts[f"{package}: {kind}"] += 1
            try:
                got = method(*args, **kwargs)
                with torch.no_grad():
                    want = model(*args, **kwargs).as_subclass(torch.Tensor)
                torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
            except Exception as exc:  # a good call must run, and match eager
                failures.append(f"{package}: {kind}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        kind = rng.choice(sorted(bad))
        args, kwargs = bad[kind](rng)
        made += 1
        counts[f"{package}: {kind}"] += 1
        try:
            method(*args, **kwargs)
        except aotstack.InputError:
            continue
        except Exception as exc:
            failures.append(f"{package}: {kind}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        failures.append(f"{package}: {kind}: accepted {describe(args, kwargs)}")
    return {"counts": dict(sorted(counts.items())), "failures": failures}


def describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{type(value).__name__}({value.dtype}, {list(value.shape)}, {value.layout}, {value.device})"
        return type(value).__name__

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


RANDOM_CALLS = """
import json, sys
from tests.test_bad_calls import run_random_calls

paths, seed, count = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print(json.dumps(run_random_calls(paths, seed, count)))
"""


def test_a_thousand_random_bad_calls_each_raise_input_error(packages):
    result = run_child(RANDOM_CALLS, json.dumps({k: str(v) for k, v in packages.items()}), "20261121", str(BAD_CALLS))

    counts = result["counts"]
    print(f"\n{BAD_CALLS} bad calls (and the good ones among them), per package and kind:")
    for kind, count in counts.items():
        print(f"  {kind}: {count}")
    assert result["failures"] == []
    assert sum(count for kind, count in counts.items() if "(good)" not in kind) == BAD_CALLS
    for package in PARTITIONINGS:
        for kind in (*BAD_KINDS, *GOOD_KINDS):
            if kind != "mkldnn" or torch.backends.mkldnn.is_available():
                assert counts.get(f"{package}: {kind}", 0) > 0, f"{package}: {kind} never ran"


# The delegates' own checks -----------------------------------------------------------------------


def delegate_handles(loaded: aotstack.LoadedProgram, kind: type) -> list[Any]:
    """The run-side handles of ``loaded.forward``'s delegates, in plan order, found in its step closures."""
    found = []
    for action in loaded.method("forward").body.actions:
        for cell in action.__closure__ or ():
            if isinstance(cell.cell_contents, kind) and cell.cell_contents not in found:
                found.append(cell.cell_contents)
    return found


def loosened(method: Method) -> InputCheck:
    """The method's argument check with every size and the device left open, as a tampered manifest might."""
    records = [InputRecord(name, "tensor", dtype="float32", shape=[None, None]) for name in method.check.names]
    return InputCheck(method.name, records, method.check.in_spec)


@pytest.mark.parametrize("package", sorted(PARTITIONINGS))
def test_delegates_check_their_inputs_whatever_the_manifest_lets_through(packages, package):
    loaded = aotstack.load(packages[package])
    method = loaded.method("forward")
    method.check = loosened(method)
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded.forward(x, x), build_model()(x, x).detach())

    cases = [
        ((torch.randn(4, 8), torch.randn(5, 8)), r"input 1 dimension 0 is 5, but an earlier dimension gave s\d+"),
        ((torch.randn(4, 9), torch.randn(4, 9)),
         r"input 0 has shape \[4, 9\]; expected float32\[s\d+ in \[2, 32\], 8\]"),
        ((torch.randn(40, 8), torch.randn(40, 8)), r"input 0 dimension 0 is 40, outside the range \[2, 32\]"),
    ]
    for args, message in cases:
        with refused(r"an aoti_cpu partition of method 'forward': " + message):
            loaded.forward(*args)


def test_the_aoti_run_side_refuses_what_its_library_was_not_compiled_for(packages):
    loaded = aotstack.load(packages["aoti"])
    first, second = delegate_handles(loaded, aoti_run.AotiHandle)
    x = torch.randn(4, 8)

    with refused(r"partition of method 'forward': input 1 has shape \[4, 7\]"):
        aoti_run.run(first, [x, torch.randn(4, 7)])
    with refused("takes 2 input"):
        aoti_run.run(first, [x])
    with refused("input 0 has dtype torch.float64"):
        aoti_run.run(first, [x.double(), x])
    with refused("input 1 must be a tensor, got NoneType"):
        aoti_run.run(first, [x, None])
    with refused("input 1 has layout torch.sparse_coo"):
        aoti_run.run(first, [x, x.to_sparse()])
    with refused("input 0 is on meta; it was compiled for cpu tensors"):
        aoti_run.run(first, [x.to("meta"), x])
    # The second delegate takes cat's [2*n, 8] and x's [n, 8]: sizes bound by one input, computed for the other.
    with refused(r"input 0 dimension 0 is 9, but it was compiled as 2\*s\d+"):
        aoti_run.run(second, [torch.randn(9, 8), x])
    with refused(r"input 0 dimension 0 is 8, but it was compiled as 2\*s\d+, which is 10"):
        aoti_run.run(second, [torch.randn(8, 8), torch.randn(5, 8)])

    # A transposed, an expanded and a negated input are copied to the layout the library reads.
    for odd in (torch.randn(8, 4).t(), torch.randn(1, 8).expand(4, 8), torch._neg_view(torch.randn(4, 8))):
        got = aoti_run.run(first, [odd, x])
        plain = aoti_run.run(first, [odd.clone().resolve_neg().contiguous(), x])
        assert len(got) == len(plain) > 0
        for have, want in zip(got, plain):
            torch.testing.assert_close(have, want)


def test_the_ort_run_side_refuses_what_its_model_was_not_exported_for(packages):
    loaded = aotstack.load(packages["stacked"])
    [handle] = delegate_handles(loaded, ort_run.OrtHandle)
    [first, _] = handle.check.boundary.inputs
    assert first.sizes[1] == 8
    x = torch.randn(4, 8)
    with refused(r"an onnxruntime partition of method 'forward': input 1 has shape"):
        ort_run.run(handle, [x, torch.randn(4, 3)])
    with refused("an onnxruntime partition .* gave s"):
        ort_run.run(handle, [x, torch.randn(5, 8)])
    # What numpy cannot share is made right first: gradients, negation, non-contiguous and expanded views.
    y = torch.randn(4, 8, requires_grad=True)
    transposed = torch.randn(8, 4).t()
    for odd in (y, torch._neg_view(-y.detach()), transposed, y.detach()[:1].expand(4, 8)):
        got = ort_run.run(handle, [x, odd])
        plain = ort_run.run(handle, [x, odd.detach().clone().resolve_neg().contiguous()])
        assert len(got) == len(plain) > 0
        for have, want in zip(got, plain):
            torch.testing.assert_close(have, want)


def test_the_session_engines_read_every_odd_view_as_the_plain_tensor_it_shows():
    from aotstack.engine.session import plain_contiguous

    x = torch.randn(4, 8)
    # The usual case between engines costs no new tensor.
    assert plain_contiguous(x) is x
    odd = (torch.nn.Parameter(x.clone()), x.clone().requires_grad_(), torch._neg_view(-x), torch.randn(8, 4).t(),
           x[:1].expand(4, 8), x[:, ::2])
    for view in odd:
        plain = plain_contiguous(view)
        assert type(plain) is torch.Tensor and plain.is_contiguous() and not plain.requires_grad
        assert not plain.is_neg() and not plain.is_conj()
        torch.testing.assert_close(plain, view.detach().resolve_neg().clone())


def test_onnx_runtime_refusing_an_argument_is_an_input_error(packages):
    loaded = aotstack.load(packages["stacked"])
    [handle] = delegate_handles(loaded, ort_run.OrtHandle)
    unchecked = ort_run.OrtHandle(**{**vars(handle), "check": None})
    with refused("an onnxruntime partition of method 'forward': ONNX Runtime refused"):
        ort_run.run(unchecked, [torch.randn(4, 8), torch.randn(4, 8, 2)])


# Processed JSON a run side cannot use --------------------------------------------------------------

SPECS = [CompileSpec(SpecKey.METHOD_NAME, b"forward")]
BOUNDARY = {"inputs": [{"dtype": "float32", "device": "cpu", "sizes": [4, 16]}], "symbols": {}}


@pytest.mark.parametrize(
    "processed, named_data, message",
    [
        ({"library": "0" * 64, "weights": {}, "input_strides": [None]}, {}, "version None .* reads version 2"),
        ({"version": 2, "library": "0" * 64, "weights": {}, "input_strides": [None]}, {}, "has no 'boundary'"),
        ({"version": 2, "library": "0" * 64, "weights": {}, "input_strides": [None],
          "boundary": {"inputs": 3, "symbols": {}}}, {}, "boundary.inputs must be a list"),
        ({"version": 2, "library": "../x", "weights": {}, "input_strides": [None], "boundary": BOUNDARY},
         {}, "'library' must be a SHA-256"),
        ({"version": 2, "library": "0" * 64, "weights": {}, "input_strides": [[0, 0]], "boundary": BOUNDARY},
         {}, r"input_strides\[0\] must be null or a layout"),
        ({"version": 2, "library": "0" * 64, "weights": {}, "input_strides": [], "boundary": BOUNDARY},
         {}, "input_strides lists 0 inputs, its boundary 1"),
        ({"version": 2, "library": "0" * 64, "input_strides": [None], "boundary": BOUNDARY,
          "weights": {"w": {"dtype": "float32", "shape": [2]}}}, {"weight:w": b"1234"},
         "takes 8 bytes, its data holds 4"),
        ({"version": 2, "library": "0" * 64, "input_strides": [None], "boundary": BOUNDARY,
          "weights": {"w": {"dtype": "floaty", "shape": [2]}}}, {}, "dtype 'floaty' is not a torch dtype"),
        ({"version": 2, "library": "0" * 64, "input_strides": [None], "boundary": BOUNDARY,
          "weights": {"w": {"dtype": "float32", "shape": [2]}}}, {}, "no named data 'weight:w'"),
        ({"version": 2, "library": "0" * 64, "input_strides": [None], "boundary": BOUNDARY, "weights": {}},
         {}, "no named data 'model.so'"),
        ({"version": 4, "library": "0" * 64, "input_strides": [None], "boundary": BOUNDARY, "weights": {},
          "gathered": ["w"]}, {}, "'gathered' names 'w', which is not one of its weights"),
        ({"version": 4, "library": "0" * 64, "input_strides": [None], "boundary": BOUNDARY, "weights": {},
          "gathered": "w"}, {}, "'gathered' must be a list"),
    ],
)
def test_aoti_processed_data_it_cannot_use_is_a_package_error_naming_the_delegate(processed, named_data, message):
    with pytest.raises(aotstack.PackageError, match="an aoti_cpu partition of method 'forward': .*" + message):
        aoti_run.AotiCpuRuntime().init(json.dumps(processed).encode(), named_data, SPECS)


@pytest.mark.parametrize(
    "processed, message",
    [
        (b"not json", "its processed data is not JSON"),
        ({"weights": {}, "inputs": ["x"], "outputs": ["y"]}, "version None"),
        ({"version": 2, "weights": {}, "inputs": ["x"], "outputs": ["y"]}, "has no 'boundary'"),
        ({"version": 2, "weights": {}, "inputs": "x", "outputs": ["y"], "boundary": BOUNDARY},
         "'inputs' must be a list"),
        ({"version": 2, "weights": {}, "inputs": [], "outputs": ["y"], "boundary": BOUNDARY}, "names 0 inputs"),
        ({"version": 2, "weights": {}, "inputs": ["x"], "outputs": ["y"], "boundary": BOUNDARY}, "'model.onnx'"),
    ],
)
def test_ort_processed_data_it_cannot_use_is_a_package_error_naming_the_delegate(processed, message):
    data = processed if isinstance(processed, bytes) else json.dumps(processed).encode()
    with pytest.raises(aotstack.PackageError, match="an onnxruntime partition of method 'forward': .*" + message):
        ort_run.OrtRuntime().init(data, {}, SPECS)


# The boundary on its own -------------------------------------------------------------------------


def boundary(*inputs: list[int | str], symbols: dict[str, tuple[int, int | None]]) -> Boundary:
    return Boundary([BoundaryInput("float32", "cpu", list(sizes)) for sizes in inputs], symbols)


def test_a_boundary_round_trips_through_json():
    original = boundary(["s0", 8], ["2*s0", "((s0 + 1)//2)"], symbols={"s0": (2, None)})
    assert Boundary.from_json(json.loads(json.dumps(original.to_json()))) == original


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "boundary must be a dict"),
        ({"inputs": [], "symbols": []}, "boundary.symbols must be a dict"),
        ({"inputs": [{"dtype": "float32", "device": "cpu", "sizes": ["s0"]}], "symbols": {}},
         r"boundary.inputs\[0\].sizes\[0\]: symbol 's0' has no range"),
        ({"inputs": [{"dtype": "float32", "device": "cpu", "sizes": [-1]}], "symbols": {}},
         r"boundary.inputs\[0\].sizes\[0\] must be a size"),
        ({"inputs": [{"dtype": "float32", "device": 3, "sizes": []}], "symbols": {}},
         r"boundary.inputs\[0\].device must be a str"),
        ({"inputs": [], "symbols": {"s0": [3]}}, r"boundary.symbols\['s0'\] must be \[min, max\]"),
        ({"inputs": [], "symbols": {"s0": [3, 1]}}, "not a range of sizes"),
        ({"inputs": [], "symbols": {"not a name": [0, 1]}}, "is not a symbol name"),
    ],
)
def test_a_malformed_boundary_is_a_package_error_naming_the_field(data, message):
    with pytest.raises(aotstack.PackageError, match=message):
        Boundary.from_json(data)


def test_symbols_bind_first_then_expressions_are_evaluated():
    check = boundary(["2*s0 + 1"], ["s1", "s0"], ["s1 - 1", "Max(1, s0)", "((s1 + 1)//2)"],
                     symbols={"s0": (1, 16), "s1": (2, 16)}).checker("a test partition")

    def call(*shapes: tuple[int, ...]) -> None:
        check([torch.zeros(shape) for shape in shapes])

    call((7,), (5, 3), (4, 3, 3))
    with refused("input 0 dimension 0 is 8, but it was compiled as 2\\*s0 \\+ 1"):
        call((8,), (5, 3), (4, 3, 3))
    with refused("input 0 dimension 0 is 7, but it was compiled as 2\\*s0 \\+ 1, which is 9"):
        call((7,), (5, 4), (4, 3, 4))
    with refused(r"input 2 dimension 2 is 4, but it was compiled as \(\(s1 \+ 1\)//2\)"):
        call((7,), (5, 3), (4, 3, 4))
    with refused(r"input 1 dimension 0 is 17, outside the range \[2, 16\] of s1"):
        call((7,), (17, 3), (16, 3, 9))


def test_one_symbol_means_one_size_across_inputs():
    check = boundary(["s0", 3], ["s0"], symbols={"s0": (1, 16)}).checker("a test partition")
    check([torch.zeros(5, 3), torch.zeros(5)])
    with refused("input 1 dimension 0 is 4, but an earlier dimension gave s0 the size 5"):
        check([torch.zeros(5, 3), torch.zeros(4)])


def test_a_linear_expression_binds_a_symbol_no_plain_dimension_binds():
    check = boundary(["2*s0"], ["s0 + 1", 2], symbols={"s0": (2, 8)}).checker("a test partition")
    check([torch.zeros(6), torch.zeros(4, 2)])
    with refused(r"input 0 dimension 0 is 7, but it was compiled as 2\*s0, and no s0"):
        check([torch.zeros(7), torch.zeros(4, 2)])
    with refused(r"input 0 dimension 0 is 18, .* no s0 in \[2, 8\] makes that"):
        check([torch.zeros(18), torch.zeros(10, 2)])
    with refused(r"input 1 dimension 0 is 5, but it was compiled as s0 \+ 1, which is 4"):
        check([torch.zeros(6), torch.zeros(5, 2)])


def test_an_expression_it_cannot_evaluate_still_means_one_size():
    # sqrt is outside the evaluator: the dimension is unchecked, but the same text is the same size.
    check = boundary(["sqrt(s0)", 2], ["sqrt(s0)"], symbols={"s0": (0, None)}).checker("a test partition")
    check([torch.zeros(3, 2), torch.zeros(3)])
    with refused(r"input 1 dimension 0 is 4, but an earlier dimension gave sqrt\(s0\)"):
        check([torch.zeros(3, 2), torch.zeros(4)])


def test_the_boundary_takes_plain_tensors_only():
    check = boundary([2, 3], symbols={}).checker("a test partition")
    check([torch.nn.Parameter(torch.zeros(2, 3))])
    for value, message in [
        (torch.zeros(2, 3).as_subclass(PlainSubclass), "is a PlainSubclass; a compiled part takes plain tensors"),
        (torch.nested.nested_tensor([torch.zeros(3), torch.zeros(2)]), "has no shape a compiled part can take"),
        (torch.zeros(2, 3, dtype=torch.int32), "has dtype torch.int32; expected float32\\[2, 3\\] on cpu"),
        (torch.zeros(2, 3).to_sparse_csr(), "has layout torch.sparse_csr"),
        (3.0, "must be a tensor, got float"),
    ]:
        with refused("a test partition: input 0 " + message):
            check([value])


# The method's own checks, on a package with no compiled code ----------------------------------------


class Positional(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.fixture
def positional(tmp_path) -> aotstack.LoadedProgram:
    path = tmp_path / "positional.pt2"
    aotstack.lower(aotstack.export(Positional(), {"forward": (torch.ones(2, 3),)}), []).save(path)
    return aotstack.load(path)


def test_a_method_exported_with_positional_arguments_refuses_keywords_by_name(positional):
    with refused(r"unknown keyword\(s\) \['scale'\]; it takes no keyword arguments"):
        positional.forward(torch.ones(2, 3), scale=2)
    with refused("pass 'x' by position"):
        positional.forward(x=torch.ones(2, 3))


def test_a_method_refuses_tensors_compiled_code_cannot_read_and_resolves_views(positional):
    x = torch.randn(2, 3)
    for value, message in [
        (x.to("meta"), "argument 'x' is a meta tensor, which holds no data; pass one on cpu"),
        (x.to_sparse(), "argument 'x' is a sparse COO tensor"),
        (torch.nested.nested_tensor([x, x]), "argument 'x' is a nested tensor"),
    ]:
        with refused(message):
            positional.forward(value)
    torch.testing.assert_close(positional.forward(torch._neg_view(x)), -x * 2)
    got = positional.forward(x.as_subclass(PlainSubclass))
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, x * 2)
