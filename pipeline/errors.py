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


def short_repr(value: object, limit: int = 80) -> str:
    """repr() of a value for a one-line message, cut to about ``limit`` characters however large the value is
    (a hostile config or request can hold megabytes in one field)."""
    import reprlib

    shortener = reprlib.Repr()
    shortener.maxstring, shortener.maxother, shortener.maxlevel = limit, limit, 3
    shortener.maxlist = shortener.maxtuple = shortener.maxset = shortener.maxdict = 6
    text = shortener.repr(value)
    if len(text) > limit + 10:  # reprlib bounds each part; a long dict key or nested mix can still add up
        text = text[:limit] + "..."
    return text.replace("\n", "\\n")


class RequestError(PipelineError, ValueError):
    """A request the engine cannot serve (prompt too long, bad sampling value, a malformed tool or format); the
    runtime stays usable."""
