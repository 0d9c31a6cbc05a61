"""Config errors a user can act on (issue 25): one line per wrong option, naming it, the value given and the
values its annotation allows; and device aliases echoed as written when the device is missing."""

from __future__ import annotations

import pickle

import pydantic
import pytest
import torch
import torch.nn as nn

import kernel_pytorch
from kernel_pytorch.cli import main
from kernel_pytorch.config import OptimizeConfig, SparseAttentionConfig, Tolerance
from kernel_pytorch.errors import ConfigError, HardwareUnavailableError, KernelPytorchError
from kernel_pytorch.hardware import ENV_DEVICE

COMPILE_LINE = ("compile='fastest' is not allowed; use one of: True, False, 'auto', 'default', 'reduce-overhead', "
                "'max-autotune', 'max-autotune-no-cudagraphs'")


def config_error(make) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        make()
    return caught.value


# ------------------------------------------------------------------------------------------ one line each


def test_a_union_option_gives_one_line_with_every_allowed_value():
    error = config_error(lambda: OptimizeConfig(compile="fastest"))
    assert str(error) == COMPILE_LINE
    assert error.problems == (COMPILE_LINE,)


def test_optimize_keyword_gives_the_same_line():
    error = config_error(lambda: kernel_pytorch.optimize(nn.Linear(2, 2), compile="fastest"))
    assert str(error) == COMPILE_LINE


def test_config_error_is_a_value_error_of_this_library_not_pydantics():
    error = config_error(lambda: OptimizeConfig(compile="fastest"))
    assert isinstance(error, ValueError) and isinstance(error, KernelPytorchError)
    assert not isinstance(error, pydantic.ValidationError)
    assert error.__suppress_context__  # pydantic's per-member report is not chained onto the traceback


@pytest.mark.parametrize("fields, line", [
    ({"mode": "eval"}, "mode='eval' is not allowed; use one of: 'auto', 'inference', 'training'"),
    ({"verify": "sometimes"}, "verify='sometimes' is not allowed; use one of: True, False, 'auto'"),
    ({"dynamic": "maybe"}, "dynamic='maybe' is not allowed; use one of: True, False, None"),
    ({"strict": "maybe"}, "strict='maybe' is not allowed; use one of: True, False"),
    ({"fp8": "fast"}, "fp8='fast' is not allowed; use one of: True, False, 'auto', or a Float8Config (or a dict of "
                      "its fields)"),
    ({"fp8": {"recipe": "blockwise"}}, "fp8.recipe='blockwise' is not allowed; use one of: 'tensorwise', 'rowwise'"),
    ({"memory": {"checkpointing": "partial"}},
     "memory.checkpointing='partial' is not allowed; use one of: 'off', 'full', 'selective'"),
    ({"memory": {"offload_optimizer": "cpu"}},
     "memory.offload_optimizer='cpu' is not allowed; use one of: True, False, 'auto'"),
    ({"memory": {"budget_gb": 0}}, "memory.budget_gb=0 is not allowed: input should be greater than 0 (or None)"),
    ({"fp8": {"filter": 3}}, "fp8.filter=3 is not allowed: input should be callable (or None)"),
    ({"disable_passes": "normalize"}, "disable_passes='normalize' is not allowed: input should be a valid tuple"),
    ({"fp8": {"tolerance": 3}}, "fp8.tolerance=3 is not allowed: input should be a valid dictionary or instance "
                                "of Tolerance"),
])
def test_each_wrong_option_reads_as_one_line_from_its_annotation(fields, line):
    assert str(config_error(lambda: OptimizeConfig(**fields))) == line


def test_several_wrong_options_give_one_line_each_in_order():
    error = config_error(lambda: OptimizeConfig(mode="eval", compile="fastest", strict=2))
    assert error.problems == (
        "mode='eval' is not allowed; use one of: 'auto', 'inference', 'training'",
        COMPILE_LINE,
        "strict=2 is not allowed; use one of: True, False",
    )


def test_long_values_are_cut_short_in_the_line():
    line = str(config_error(lambda: OptimizeConfig(mode="x" * 500)))
    assert line.startswith("mode='xxx") and "..." in line and len(line) < 200


# --------------------------------------------------------------------------------------------- nested


def test_options_inside_nested_configs_are_named_by_their_path():
    error = config_error(lambda: OptimizeConfig(sparse_attention={"keep_ratio": 1.5, "mode": "dense"}))
    assert error.problems == (
        "sparse_attention.mode='dense' is not allowed; use one of: 'topk'",
        "sparse_attention.keep_ratio=1.5 is not allowed: input should be less than or equal to 1 (or None)",
    )
    error = config_error(lambda: OptimizeConfig(tolerances={"float32": {"outputs": -1}}))
    assert error.problems == (
        "tolerances['float32'].outputs=-1 is not allowed: input should be greater than 0",
        "tolerances['float32'].gradients is required",
    )
    line = str(config_error(lambda: OptimizeConfig(disable_passes=("normalize", 3))))
    assert line == "disable_passes[1]=3 is not allowed: input should be a valid string"


def test_every_config_model_raises_config_error():
    assert str(config_error(lambda: SparseAttentionConfig(topk=0))) == (
        "topk=0 is not allowed: input should be greater than 0 (or None)")
    assert str(config_error(lambda: Tolerance(outputs=1e-3, gradients="small"))) == (
        "gradients='small' is not allowed: input should be a valid number, unable to parse string as a number")
    assert str(config_error(lambda: OptimizeConfig.model_validate({"compile": "fastest"}))) == COMPILE_LINE
    assert str(config_error(lambda: OptimizeConfig.model_validate_json('{"compile": "fastest"}'))) == COMPILE_LINE
    assert str(config_error(lambda: OptimizeConfig.model_validate(3))) == (
        "OptimizeConfig: input should be a valid dictionary or instance of OptimizeConfig")


def test_a_frozen_option_says_it_cannot_be_set():
    config = OptimizeConfig()
    line = str(config_error(lambda: setattr(config, "compile", False)))
    assert line == "compile cannot be set: OptimizeConfig is frozen (build a new one with the value)"


# ------------------------------------------------------------------------------------ custom validators


@pytest.mark.parametrize("fields, line", [
    ({"fp8": {"emulate": True}}, "fp8 emulate=True runs FP8 numerics without FP8 speed, so there is nothing for "
                                 "mode=False to measure or decide: use fp8={'mode': True, 'emulate': True}"),
    ({"sparse_attention": {"block": 100}}, "block must be a multiple of 128 (FlexAttention's tile), got 100"),
    ({"sparse_attention": {"topk": 4, "keep_ratio": 0.1}}, "set topk or keep_ratio, not both"),
    ({"tolerances": {"f32": {"outputs": 1, "gradients": 1}}},
     "tolerances: ['f32'] are not torch dtype names (e.g. 'float32', 'bfloat16')"),
])
def test_validators_messages_are_kept_as_written(fields, line):
    assert str(config_error(lambda: OptimizeConfig(**fields))) == line


# ------------------------------------------------------------------------------------- unknown options


def test_an_unknown_option_suggests_the_closest_known_one():
    line = str(config_error(lambda: OptimizeConfig(compil=True)))
    assert line.startswith("unknown OptimizeConfig option 'compil'; did you mean 'compile'? (options: device, ")
    line = str(config_error(lambda: OptimizeConfig(sparse_attention={"blok": 256})))
    assert line.startswith("sparse_attention: unknown SparseAttentionConfig option 'blok'; did you mean 'block'?")
    assert str(config_error(lambda: Tolerance(outputs=1, gradients=1, output=1))).startswith(
        "unknown Tolerance option 'output'; did you mean 'outputs'?")


# ---------------------------------------------------------------------------------------------- device


def test_an_unknown_device_lists_vendors_and_aliases_as_written():
    line = str(config_error(lambda: OptimizeConfig(device="GPU")))
    assert line == ("device='GPU' is not allowed; use one of: 'auto', 'nvidia', 'amd', 'tpu', 'intel', 'cpu', "
                    "'cuda', 'rocm', 'hip', 'xla', 'xpu'")


def test_an_alias_is_the_vendor_everywhere_but_remembers_its_spelling():
    config = OptimizeConfig(device="CUDA")
    assert config.device == "nvidia" and str(config.device) == "nvidia" and repr(config.device) == "'nvidia'"
    assert config.device.written == "CUDA"
    assert config == OptimizeConfig(device="nvidia")
    assert config.model_dump(mode="json")["device"] == "nvidia"
    assert OptimizeConfig.model_validate({**config.model_dump(), "compile": False}).device.written == "CUDA"
    assert OptimizeConfig.model_validate({**config.model_dump(), "device": "amd"}).device.written == "amd"
    assert pickle.loads(pickle.dumps(config)).device.written == "CUDA"
    assert OptimizeConfig().device.written == "auto"


@pytest.fixture
def no_gpu(monkeypatch):
    """A CPU build of torch, whatever this machine has, and no device forced from the environment."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(ENV_DEVICE, raising=False)


def test_optimize_with_a_missing_device_echoes_the_alias_given(no_gpu):
    with pytest.raises(HardwareUnavailableError) as caught:
        kernel_pytorch.optimize(nn.Linear(2, 2), device="cuda")
    message = str(caught.value)
    assert message.startswith("device='cuda' was requested (by device='cuda') but the CUDA probe failed")
    assert "'nvidia'" not in message


def test_a_config_passed_with_overrides_keeps_the_spelling(no_gpu):
    with pytest.raises(HardwareUnavailableError, match=r"^device='Cuda' was requested \(by device='Cuda'\)"):
        kernel_pytorch.optimize(nn.Linear(2, 2), OptimizeConfig(device="Cuda"), compile=False)


def test_the_environment_variable_is_echoed_as_written(no_gpu, monkeypatch):
    monkeypatch.setenv(ENV_DEVICE, "CUDA")
    with pytest.raises(HardwareUnavailableError) as caught:
        kernel_pytorch.optimize(nn.Linear(2, 2))
    assert str(caught.value).startswith(f"device='CUDA' was requested (by {ENV_DEVICE}='CUDA') but the CUDA probe")


def test_cli_info_echoes_the_alias_given(no_gpu, capsys):
    assert main(["info", "--device", "cuda"]) == 2
    output = capsys.readouterr().out
    assert "device='cuda' was requested (by device='cuda') but the CUDA probe failed" in output
    assert "'nvidia'" not in output


# ------------------------------------------------------------------------------------ deprecated flat options


@pytest.mark.parametrize("flat, section, field, value", [
    ("fp8_recipe", "fp8", "recipe", "rowwise"),
    ("fp8_emulate", "fp8", "emulate", True),
    ("checkpointing", "memory", "checkpointing", "full"),
    ("memory_budget_gb", "memory", "budget_gb", 1.5),
    ("offload_activations", "memory", "offload_activations", "auto"),
    ("offload_optimizer", "memory", "offload_optimizer", "auto"),
])
def test_flat_options_still_work_for_a_release_with_a_warning_naming_the_new_spelling(flat, section, field, value):
    extra = {"fp8": True} if flat == "fp8_emulate" else {"memory": {"checkpointing": "full"}} if flat == \
        "memory_budget_gb" else {}
    with pytest.warns(FutureWarning, match=f"'{flat}' is deprecated.*{section}={{'{field}': ...}}"):
        config = OptimizeConfig(**extra, **{flat: value})
    assert getattr(getattr(config, section), field) == value
    with pytest.warns(FutureWarning, match=f"config.{section}.{field}"):
        assert getattr(config, flat) == value


def test_flat_options_through_optimize_keep_the_other_section_fields():
    with pytest.warns(FutureWarning, match="fp8_recipe"):
        config = kernel_pytorch.api._config_with(OptimizeConfig(fp8={"mode": "auto", "include_output_head": True}),
                                                 {"fp8_recipe": "rowwise"})
    assert (config.fp8.mode, config.fp8.recipe, config.fp8.include_output_head) == ("auto", "rowwise", True)


def test_fp8_mode_shorthand_needs_no_section():
    assert OptimizeConfig(fp8="auto").fp8.mode == "auto"
    assert OptimizeConfig(fp8=True).fp8 == OptimizeConfig(fp8={"mode": True}).fp8


def test_a_wrong_section_is_not_hidden_by_a_flat_option():
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="memory='full' is not allowed"):
        OptimizeConfig(memory="full", checkpointing="full")
