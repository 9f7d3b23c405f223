"""User-facing errors: the message names the file, key or sample and says what to do.

The CLI prints these without a traceback and exits non-zero; anything else is a bug and
keeps its traceback.
"""


class PipelineError(RuntimeError):
    pass
