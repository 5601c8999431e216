"""Config: one pydantic model per backend, all sharing this base.

The registry picks the model from the ``backend`` field, so a config is plain
data (a dict, a JSON string, a vLLM ``kv_connector_extra_config``) until it is
validated, and a bad field is reported with the backend's name, the field path
and the value.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class BackendConfig(BaseModel):
    """Fields every backend understands. Subclass it and add your own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(description="registered name of the backend")
    timeout_s: float = Field(
        30.0, gt=0, description="deadline for one transfer; past it the keys fail, never hang"
    )
