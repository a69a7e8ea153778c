"""User-facing errors. The CLI prints their message as one line and exits non-zero without a traceback."""


class PipelineError(Exception):
    """A problem the user can fix; the message names the field or file, the value and the fix."""

    exit_code = 2


class ConfigError(PipelineError):
    """The YAML config is malformed or fails validation."""


class ModelError(PipelineError):
    """A model folder, hub id, weights file or tokenizer cannot be used."""


class CompatibilityError(PipelineError):
    """The draft and target cannot be paired (tokenizer, architecture, lengths)."""


class EngineError(PipelineError):
    """An engine folder is missing, incomplete, stale or built by another config or version."""


class BackendUnavailable(PipelineError):
    """The selected backend needs software or hardware this machine does not have."""
