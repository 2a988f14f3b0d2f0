import pytest

from protos.defaults import DTYPES, FP8_DTYPES
from trainer.sizing.precision import SPECS, Precision, from_config_dtype


@pytest.mark.parametrize("name", [k for k in DTYPES if k and k not in FP8_DTYPES])
def test_every_config_spelling_maps_to_the_precision_of_its_torch_dtype(name):
    by_torch = {"float32": Precision.FP32, "bfloat16": Precision.BF16, "float16": Precision.FP16}
    torch_name = DTYPES[name]
    assert torch_name is not None
    assert from_config_dtype(name, on_cuda=True) is by_torch[torch_name]


def test_automatic_is_the_trainers_choice_and_float8_maps_by_name():
    assert from_config_dtype("", on_cuda=True) is Precision.BF16
    assert from_config_dtype("", on_cuda=False) is Precision.FP32
    for name in ("fp8", "FP8", "float8"):
        assert from_config_dtype(name, on_cuda=True) is Precision.FP8
    with pytest.raises(ValueError, match="train.dtype: 'fp12'"):
        from_config_dtype("fp12", on_cuda=True)


def test_every_precision_keeps_adam_in_fp32_and_a_master_copy_beside_narrow_weights():
    for precision, spec in SPECS.items():
        assert spec.states.optimizer == 8
        assert spec.states.gradients == 4  # autograd accumulates into fp32 parameters
        narrow = spec.states.weights < 4
        assert spec.states.master == (4 if narrow else 0), precision
