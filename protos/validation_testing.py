"""The job-spec validation tests' helpers (validation_test.py, validation_layout_test.py)."""

import pytest

from protos import job_pb2
from protos.config_yaml import ConfigError
from protos.validation import validate_job_spec


def spec_with(**fields) -> job_pb2.JobSpec:
    """A valid PRETRAIN spec with `a__b__c=value` set (the path under JobSpec)."""
    spec = job_pb2.JobSpec(name="ok", kind=job_pb2.PRETRAIN)
    for key, value in fields.items():
        *sections, name = key.split("__")
        message = spec
        for section in sections:
            message = getattr(message, section)
        setattr(message, name, value)
    return spec


def error(spec) -> str:
    with pytest.raises(ConfigError) as err:
        validate_job_spec(spec)
    return str(err.value)
