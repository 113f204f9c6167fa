"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class TTRankError(Exception):
    """An error caused by input the user can fix (bad file, missing flag, incompatible data)."""

    exit_code = 2


class ModelLoadError(TTRankError):
    """The ONNX file cannot be read or imported."""


class UnsupportedOpError(ModelLoadError):
    """The model uses an ONNX op the TVM importer does not handle."""


class DynamicShapeError(ModelLoadError):
    """An input has dynamic dims and no --input-shape binds them."""


class StoreError(TTRankError):
    """A donor store or dataset cannot be used."""


class RankerError(TTRankError):
    """A ranker file cannot be used (missing, corrupt, or another feature-schema version)."""


class CheckError(TTRankError):
    """Compiled outputs do not match the reference."""

    exit_code = 3
