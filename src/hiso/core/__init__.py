"""The protocol, free of files, networks and printing: directions, preconditioner, estimator,
history, messages, server and client, and the contract methods plug into (:mod:`hiso.core.method`).
Runners (simulator, Flower, CLI) drive these objects; nothing here imports a method."""

from .client import Client
from .config import ZOConfig
from .directions import DirectionGenerator, direction, tensor_seed
from .estimator import local_update
from .history import HistoryWriter, RoundRecord, read_history
from .messages import (Downlink, Hello, JoinError, MessageError, Uplink, Welcome, Wire, decode_downlink,
                       decode_uplink, encode_downlink, encode_uplink)
from .method import Method
from .perturb import Perturber, Shift
from .preconditioner import PreconditionerConfig
from .server import RoundPlan, Server
from .state import ModelState, trainable_params

__all__ = ["Client", "ZOConfig", "DirectionGenerator", "direction", "tensor_seed", "local_update",
           "HistoryWriter", "RoundRecord", "read_history", "Downlink", "Hello", "JoinError", "MessageError", "Uplink",
           "Welcome", "Wire", "decode_downlink", "decode_uplink", "encode_downlink", "encode_uplink", "Method",
           "Perturber", "Shift", "PreconditionerConfig", "RoundPlan", "Server", "ModelState", "trainable_params"]
