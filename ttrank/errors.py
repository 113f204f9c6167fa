"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class TTRankError(Exception):
    """An error caused by input the user can fix (bad file, missing flag, incompatible data)."""

    exit_code = 2
    # whether TVM's native log of the run says more about it (the CLI then prints its path)
    native_log = False


class ModelLoadError(TTRankError):
    """The ONNX file cannot be read or imported."""


class UnsupportedOpError(ModelLoadError):
    """The model uses an ONNX op the TVM importer does not handle."""


class DynamicShapeError(ModelLoadError):
    """An input has dynamic dims and no --input-shape binds them."""


class ImporterError(ModelLoadError):
    """TVM's ONNX importer rejected the graph (its own messages are in the native log)."""

    native_log = True


class TooLargeError(ModelLoadError):
    """A tensor of the model is larger than this machine could ever hold."""


class UnsafeModelError(ModelLoadError):
    """The file asks for something ttrank refuses to do, e.g. read data outside its folder."""


class OutputError(TTRankError):
    """An output cannot be written (read-only folder, full disk); the previous one is intact."""


class DeviceError(TTRankError):
    """The measuring device cannot be reached: RPC tracker silent, no device with the key."""


class BusyError(TTRankError):
    """Another ttrank process is writing the same output."""


class StoreError(TTRankError):
    """A donor store or dataset cannot be used."""


class RankerError(TTRankError):
    """A ranker file cannot be used (missing, corrupt, or another feature-schema version)."""


class CheckError(TTRankError):
    """Compiled outputs do not match the reference."""

    exit_code = 3
