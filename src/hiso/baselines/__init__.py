"""The paper's full-model baselines (FedZO, FedAvg, FedAdam, FedYogi, FedAdagrad).

They exchange d-dimensional vectors each way, unlike HiSo's seeds and scalars; they share
HiSo's tasks, client sampling, metrics and CLI (runner: :mod:`hiso.runners.fullmodel`).
"""

from .local import fedzo_seeds, sgd_local, zo_local
from .messages import (FullDownlink, FullUplink, decode_downlink, decode_uplink, downlink_size,
                       encode_downlink, encode_uplink, flatten, unflatten, uplink_size)
from .server_opt import (AdaptiveState, AvgState, ServerOpt, fedadagrad, fedadam, fedavg, fedyogi,
                         make_server_opt)

__all__ = [
    "fedzo_seeds", "sgd_local", "zo_local", "FullDownlink", "FullUplink", "decode_downlink",
    "decode_uplink", "downlink_size", "encode_downlink", "encode_uplink", "flatten", "unflatten",
    "uplink_size", "AdaptiveState", "AvgState", "ServerOpt", "fedadagrad", "fedadam", "fedavg",
    "fedyogi", "make_server_opt",
]
