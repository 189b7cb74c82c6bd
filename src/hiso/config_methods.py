"""The method-specific rules of :class:`hiso.config.RunConfig`: what secure aggregation, Ferret,
the one-seed methods (FeedSign, FedKSeed) and differential privacy require of a run, and the
values they resolve. A mixin, so config.py keeps the fields and the checks every run shares."""

from __future__ import annotations

import functools
import math


class MethodRules:
    """Checks and derived values of the methods' options (mixed into ``RunConfig``)."""

    def _secagg_checks(self) -> None:
        """Secure aggregation gives the server the sum of the answers and nothing else: only the
        plain (unweighted) mean of hiso and decomfl can use it; its defaults are resolved here
        (and so recorded in config.json)."""
        if not self.secagg:
            given = [n for n in ("secagg_clip", "secagg_threshold") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only with secagg")
            return
        if self.algorithm not in ("hiso", "decomfl"):
            why = ("its majority vote counts +-1 per client, which a secure sum cannot check"
                   if self.algorithm == "feedsign" else "its server needs more than the plain sum")
            raise ValueError(f"secure aggregation is for hiso and decomfl, not {self.algorithm}: {why}")
        if self.aggregate != "mean" or self.weighted:
            raise ValueError("secure aggregation gives the server only the sum: use aggregate mean without weighted "
                             f"(not {'weighted' if self.weighted else self.aggregate})")
        if self.byzantine:
            raise ValueError("secure aggregation hides each answer: no simulated Byzantine clients with it")
        if self.sampled < 2:
            raise ValueError("secure aggregation needs sampled >= 2 (with one client the sum is its answer)")
        if self.secagg_clip is None:
            central = self.dp_clip is not None and self.dp_mode == "central"
            self.secagg_clip = 2.0 ** math.ceil(math.log2(self.dp_clip)) if central else 256.0
        if self.secagg_threshold is None:
            self.secagg_threshold = max(2, self.sampled // 2 + 1)
        if self.secagg_threshold > self.sampled:
            raise ValueError(f"secagg_threshold ({self.secagg_threshold}) cannot exceed sampled ({self.sampled})")
        self.secagg_config.check_clients(self.sampled)

    @property
    def secagg_config(self):
        """The secure aggregation's grid and threshold (:class:`hiso.methods.secagg.SecAggConfig`), or None."""
        if not self.secagg:
            return None
        from .methods.secagg import SecAggConfig
        return SecAggConfig(self.secagg_clip, self.secagg_bits, self.secagg_modulus_bits, self.secagg_threshold)

    def _ferret_checks(self) -> None:
        from .core.seeds import MAX_PER_ROUND
        if self.ferret_k < 1 or self.ferret_blocks < 1:
            raise ValueError(f"ferret needs ferret_k >= 1 and ferret_blocks >= 1, got {self.ferret_k} and "
                             f"{self.ferret_blocks}")
        if self.ferret_k * self.ferret_blocks > MAX_PER_ROUND:
            raise ValueError(f"ferret_k x ferret_blocks = {self.ferret_k * self.ferret_blocks} seeds a round, more "
                             f"than the format allows ({MAX_PER_ROUND})")
        for name in ("dp_clip", "momentum", "lr_decay", "step_norm"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is for hiso and decomfl, not ferret")
        if self.directions in ("sparse", "lowrank"):
            raise ValueError(f"ferret projects on a dense direction family, not {self.directions}")

    def _one_seed_defaults(self) -> None:
        """FeedSign (arXiv 2501.17610) and FedKSeed (arXiv 2312.06353) take one seed per step and a
        MeZO-style two-point estimate: P = 1 and central differences unless set explicitly; other
        P, DP and momentum are refused."""
        given = self.model_fields_set
        if "perturbations" not in given:
            self.perturbations = 1
        if "difference" not in given:
            self.difference = "central"
        if self.perturbations != 1:
            raise ValueError(f"{self.algorithm} uses one seed per step: perturbations must be 1, got {self.perturbations}")
        if self.dp_clip is not None:
            raise ValueError(f"differential privacy is for hiso and decomfl, not {self.algorithm}")
        if self.momentum is not None:
            raise ValueError(f"momentum is for hiso and decomfl, not {self.algorithm}")

    def unused_options(self) -> dict[str, str]:
        """The options set to a value other than their default that this run's algorithm never
        reads (``nu`` on decomfl, ``server_lr`` on hiso), each with whose they are: a run names
        them, a comparison's variant refuses them."""
        out = {name: whose for names, users, whose in _ALGORITHM_OPTIONS if self.algorithm not in users
               for name in self.changed(names)}
        if self.step_norm is None and self.changed(["step_norm_beta"]):
            out["step_norm_beta"] = "with step_norm only"
        for names, off, whose in ((("byzantine_per_round", "attack", "attack_scale"), not self.byzantine,
                                   "with byzantine only"),
                                  (("trim",), self.aggregate != "trimmed-mean", "with aggregate trimmed-mean only"),
                                  (("secagg_bits", "secagg_modulus_bits"), not self.secagg, "with secagg only")):
            if off:
                out.update(dict.fromkeys(self.changed(names), whose))
        if self.algorithm == "feedsign" and self.byzantine:  # a random lie's scale cannot change its sign
            out.update(dict.fromkeys(self.changed(["attack_scale"]), "a lying sign has no scale"))
        return out

    def weak_aggregation(self) -> list[str]:
        """Why the robust rule asked for cannot do its work in this run (a trimmed mean that trims
        none of a round's answers, attackers a round beyond what the rule outvotes): said when the
        run starts, since a robust-aggregation table built on it would read as robust."""
        n, notes = self.sampled, []
        if self.aggregate == "trimmed-mean":
            cut = math.floor(self.trim * n)
            if cut == 0:
                fix = f"give trim >= {math.ceil(1000 / n) / 1000:g}, or " if n > 2 else ""  # trim < 0.5
                notes.append(f"aggregate trimmed-mean with trim {self.trim:g} drops floor({self.trim:g} x {n}) = 0 "
                             f"of the {n} answers a round at each end: it is the plain mean here ({fix}sample more "
                             "clients)")
            elif self.byzantine_per_round and self.byzantine > cut:
                notes.append(f"{self.byzantine} attackers a round outnumber the {cut} answer{'s' if cut > 1 else ''} "
                             f"trimmed-mean drops at each end (trim {self.trim:g} of {n}): it is not robust to them")
        elif self.aggregate == "median" and self.byzantine_per_round and 2 * self.byzantine >= n:
            notes.append(f"{self.byzantine} attackers a round are at least half of its {n} answers: the median is "
                         "not robust to them")
        return notes

    @property
    def dp_noise(self) -> float | None:
        """The DP noise multiplier: as given, or solved from dp_epsilon (None without DP): the
        smallest z at which the client sampled most often in the run's own sample (drawn from
        the run seed as the server will draw it) spends at most dp_epsilon, without amplification
        by sampling (the sample is public: :mod:`hiso.methods.privacy`, "Planning")."""
        if self.dp_clip is None:
            return None
        if self.dp_noise_multiplier is not None:
            return self.dp_noise_multiplier
        return _solved_noise(self.dp_epsilon, self.rounds, self.dp_delta, self.clients, self.sampled, self.seed)

    def dp_spent(self, participations: int) -> float | None:
        """Epsilon at dp_delta of a client that took part in ``participations`` rounds, against a
        reader who knows the sample (None without DP or without a delta)."""
        if self.dp_clip is None or self.dp_delta is None:
            return None
        from .methods.privacy import epsilon_spent
        return epsilon_spent(self.dp_noise, participations, self.dp_delta)


# options only some algorithms read: (names, the algorithms that read them, whose they are)
_ALGORITHM_OPTIONS = (
    (("nu", "eps", "h_min", "h_max", "h_source", "h_stat", "h_granularity", "h_bias_correction"),
     ("hiso",), "HiSo's preconditioner"),
    (("server_lr",), ("fedzo", "fedavg", "fedadam", "fedyogi", "fedadagrad", "ferret"),
     "the full-model baselines' and ferret's server step"),
    (("beta1", "beta2"), ("fedadam", "fedyogi"), "fedadam's and fedyogi's server moments"),
    (("server_tau",), ("fedadam", "fedyogi", "fedadagrad"), "the adaptive server optimisers'"),
    (("wire_dtype",), ("fedzo", "fedavg", "fedadam", "fedyogi", "fedadagrad"), "the full-model baselines' messages"),
    (("seed_pool", "seed_sampling"), ("fedkseed",), "fedkseed's"),
    (("ferret_k", "ferret_blocks"), ("ferret",), "ferret's"),
    (("perturbations", "mu", "difference"), ("hiso", "decomfl", "feedsign", "fedkseed", "fedzo"),
     "the zeroth-order estimate's"),
)


@functools.lru_cache(maxsize=64)
def _solved_noise(eps: float, rounds: int, delta: float, clients: int, sampled: int, seed: int) -> float:
    from .methods.privacy import noise_for, planned_participations
    return noise_for(eps, planned_participations(seed, clients, sampled, rounds), delta)
