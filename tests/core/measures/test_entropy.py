"""``x_log_x`` against scipy's ``xlogy(x, x)``: zeros, values below float32's tiny, the whole range of attention weights."""

import numpy as np
import pytest
import torch
from scipy.special import xlogy

from bertology.core.measures.entropy import x_log_x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_x_log_x_equals_scipys_xlogy_with_zeros_and_values_below_tiny(dtype):
    rng = np.random.default_rng(0)
    tiny = torch.finfo(dtype).tiny
    values = np.concatenate([[0.0, 1.0, tiny, tiny / 4, 1e-30, 0.5], rng.random(1000), rng.random(1000) ** 40])
    tensor = torch.tensor(values, dtype=dtype)
    expected = xlogy(tensor.double().numpy(), tensor.double().numpy())
    np.testing.assert_allclose(x_log_x(tensor).double().numpy(), expected, rtol=2e-7 if dtype == torch.float32 else 1e-15,
                               atol=1e-35)
    assert x_log_x(tensor)[0] == 0 and x_log_x(tensor)[1] == 0


def test_x_log_x_may_write_over_its_input_and_refuses_half_precision():
    values = torch.tensor([0.0, 0.25, 0.75])
    out = x_log_x(values, out=values)
    assert out.data_ptr() == values.data_ptr()
    np.testing.assert_allclose(values.numpy(), [0.0, 0.25 * np.log(0.25), 0.75 * np.log(0.75)], rtol=1e-7)
    with pytest.raises(TypeError, match="float32 or float64"):
        x_log_x(torch.tensor([0.5], dtype=torch.bfloat16))
