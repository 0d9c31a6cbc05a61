from __future__ import annotations

import copy
import os
import tempfile

# Under pytest-xdist (the README's ``-n auto``) each worker gets an Inductor and a Triton cache of its own, set
# before torch reads them, and an equal share of the cores for torch's threads (set below).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    _CACHES = os.path.join(tempfile.gettempdir(), f"kernel_pytorch_tests_{os.getuid()}", _WORKER)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHES, "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHES, "triton"))

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode

from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

from .triton_interpreter import InterpretedRun

if _WORKER:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


class PassThroughMode(TorchDispatchMode):
    """A dispatch mode that only forwards each op: where selective checkpointing, a FLOP counter or
    make_fx / AOT autograd's tracing modes stand (ops then see no plain eager call)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own models; a clean dynamo cache keeps recompile limits and guards
    # from one test out of the next.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def interpreted_tests(request, tmp_path_factory) -> InterpretedRun:
    """One child pytest under Triton's interpreter for the ``test_interp_*`` tests of every module in this
    session with a test that asks for this fixture (tests/triton_interpreter.py): started once, not once
    per module."""
    files = {str(item.path) for item in request.session.items if "interpreted_tests" in item.fixturenames}
    return InterpretedRun(files, tmp_path_factory.mktemp("interpreted"))


@pytest.fixture
def gemv_on_cpu(monkeypatch):
    """The decode GEMV's launcher (ops/decode_linear.grouped_gemv) serving CPU tensors under Triton's interpreter;
    its launch counts (tests of the plain and the fused GEMV)."""
    from kernel_pytorch.ops import decode_linear

    from .triton_interpreter import route_to_triton

    return route_to_triton(monkeypatch, decode_linear, ("grouped_gemv",), ())


@pytest.fixture
def tiny_lm():
    torch.manual_seed(0)
    return LlamaStyleLM(LlamaStyleConfig.tiny())


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An unoptimized copy to compare against."""
    return copy.deepcopy(model)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


def capture_graph(module: torch.nn.Module, inputs: tuple, dynamic: bool = False) -> tuple[torch.fx.GraphModule, list]:
    """``module``'s one Dynamo graph on ``inputs`` (fullgraph), with the example arguments Dynamo passed
    (parameters and buffers included), for tests that run passes by hand."""
    import warnings

    torch._dynamo.reset()
    box: dict = {}

    def backend(gm, example_inputs):
        box["gm"], box["inputs"] = gm, list(example_inputs)
        return gm.forward

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    return box["gm"], box["inputs"]


def assert_same_values_and_gradients(model: torch.nn.Module, reference: torch.nn.Module, x: torch.Tensor,
                                     *constants: torch.Tensor) -> None:
    """``model`` (rewritten) and ``reference`` (the original) agree on fresh input ``x`` in fp32: outputs
    within 1e-5, input and parameter gradients within 1e-4 (relative norm). ``constants`` (RoPE tables, a
    mask) follow ``x`` in both calls and take no gradient."""
    x = x.detach().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, expected = model(x, *constants), reference(x_ref, *constants)
    assert rel_err(out, expected) < 1e-5
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert rel_err(x.grad, x_ref.grad) < 1e-4
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, p_ref.grad) < 1e-4, name


def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        _group_by_shared_fixture(items)
    # Triton kernel tests need TRITON_INTERPRET=1 set before Triton is imported; in a process without
    # it they are deselected, and test_norm_ops.py::test_triton_kernels_in_a_subprocess runs them.
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    deselected = [item for item in items if item.get_closest_marker("triton_interpret")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("triton_interpret")]


def _group_by_shared_fixture(items) -> None:
    """Tests sharing a module- or session-scoped fixture (a benchmark's CPU run, the one interpreted-Triton child)
    go to one xdist worker (``--dist loadgroup``), so that the fixture is built once, not once per worker."""
    for item in items:
        for name in item.fixturenames:
            definitions = item._fixtureinfo.name2fixturedefs.get(name) or ()
            ours = definitions and definitions[-1].baseid.startswith("tests")  # not pytest's own (tmp_path_factory)
            if ours and definitions[-1].scope in ("module", "package", "session"):
                item.add_marker(pytest.mark.xdist_group(f"{definitions[-1].baseid}::{name}"))
                break
