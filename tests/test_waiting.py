"""A backend's own error from a collective we do not wait on ourselves (FSDP2's, torch's)
becomes the CommError our own waits raise: it names the step, the rank and
comm.timeout_s; any other error passes unchanged."""

from __future__ import annotations

import pytest

from ray_zep.distributed.waiting import collectives_of
from ray_zep.errors import CommError

pytestmark = pytest.mark.unit

GLOO_TIMEOUT = (
    "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms "
    "for send operation to complete\nException raised from ..."
)


def test_a_backend_timeout_is_a_comm_error_naming_the_limit() -> None:
    with pytest.raises(CommError) as caught, collectives_of("step 3", 5.0, 2):
        raise RuntimeError(GLOO_TIMEOUT)
    message = str(caught.value)
    assert message.startswith("step 3 on rank 2 failed or exceeded comm.timeout_s=5: ")
    assert "Timed out waiting 5000ms" in message and "Exception raised" not in message


def test_other_errors_pass_unchanged() -> None:
    with pytest.raises(RuntimeError, match="shape mismatch"), collectives_of("step 1", 5.0, 0):
        raise RuntimeError("shape mismatch in a matmul")
    with pytest.raises(ValueError), collectives_of("step 1", 5.0, 0):
        raise ValueError("not a backend error")
