"""The method-specific rules of :class:`hiso.config.RunConfig`: what secure aggregation, the
one-seed methods (FeedSign, FedKSeed) and differential privacy require of a run, and the
values they resolve. A mixin, so config.py keeps the fields and the checks every run shares."""

from __future__ import annotations

import functools
import math


class MethodRules:
    """Checks and derived values of the methods' options (mixed into ``RunConfig``)."""

    @property
    def method(self):
        """What the registry knows of this run's method (:class:`hiso.methods.registry.MethodInfo`)."""
        from .methods.registry import method_info
        return method_info(self.algorithm)

    @property
    def sends_signs(self) -> bool:
        """Whether the method's clients upload one sign bit per scalar (FeedSign's wire)."""
        return getattr(getattr(self.method.build(self), "uplink", None), "name", None) == "signs"

    def _method_opts_checks(self) -> None:
        """Type a method's options by its Method class's fields (a user's method, or a built-in one:
        each is a class on the contract; DeComFL, FeedSign, greedy have no options of their own). A
        built-in class whose fields are flags too (HiSo's, Ferret's, the full-model baselines') has
        all of them recorded, at their defaults where not given (config.json names the values its
        run used; a server_lr not given as None, the method's default), and checked here."""
        from .methods.options import check_options, fields_of
        from .methods.registry import is_user_method
        cls = self.method.option_class
        if getattr(cls, "flags", None) and not is_user_method(self.algorithm):
            opts = check_options(cls, self.method_opts, self.algorithm)
            built = cls(**opts)  # its own checks (nu in [0, 1], ...), one line
            self.method_opts = {name: getattr(built, name) for name in fields_of(cls)}
            return
        if not self.method_opts:
            return
        if not fields_of(cls):
            raise ValueError(f"method_opts: {self.algorithm} has no options of its own (its options are flags: "
                             "hiso run --help); method_opts is for a Method subclass's fields")
        self.method_opts = check_options(cls, self.method_opts, self.algorithm)

    def _base_dtype_checks(self) -> None:
        """A base held below float32 is frozen: only LoRA's adapters train (and stay float32)."""
        if self.base_dtype != "float32" and self.lora_r is None:
            raise ValueError(f"base_dtype {self.base_dtype}: the base is frozen at that precision, so it needs "
                             "LoRA (--lora-r); full-parameter fine-tuning trains the base in float32")

    def _lacks(self, cap: str, what: str, builtin_msg: str) -> ValueError:
        """The refusal of ``what`` for a method without capability ``cap``: a built-in method's
        ``builtin_msg`` (which names the methods that have it), or, for a user's method, the
        capability it does not declare and how to declare it."""
        from .methods.registry import is_user_method
        if not is_user_method(self.algorithm):
            return ValueError(builtin_msg)
        return ValueError(f"{what} needs the capability {cap!r}, which {self.method.display} does not declare: if it "
                          f"supports it, add {cap!r} to its class's `can` (hiso.methods.registry.CAPABILITIES)")

    def _method_checks(self, faults: float) -> None:
        """What the run's method can be combined with, asked of its registry entry
        (:mod:`hiso.methods.registry`): each option that needs a capability it lacks is refused."""
        from .config_parse import parse_attacks
        from .methods.registry import in_words, with_capability
        can = self.method.can
        attacks = parse_attacks(self.attack)
        if self.sends_signs and self.byzantine and (bad := [a for a in attacks if a in ("scale", "nan")]):
            raise ValueError(f"{self.algorithm}'s clients send signs: attack {' and '.join(bad)} cannot be sent as one "
                             "(a scaled sign is the same sign, a NaN packs as -1): give --attack sign-flip or random")
        if (faults or self.byzantine) and "faults" not in can:
            raise self._lacks("faults", "simulated faults and attackers", f"faults, attackers and robust aggregation "
                              f"are simulated for the seed-and-scalar methods ({', '.join(with_capability('faults'))}), "
                              f"not {self.algorithm}")
        if self.aggregate != "mean" and "robust" not in can:
            raise self._lacks("robust", f"aggregate {self.aggregate}", f"faults, attackers and robust aggregation are "
                              f"simulated for the seed-and-scalar methods ({', '.join(with_capability('faults'))}), "
                              f"not {self.algorithm}")
        if self.grad_clip is not None and "grad_clip" not in can:
            raise self._lacks("grad_clip", "grad_clip", f"grad_clip is for {in_words(with_capability('grad_clip'))}, "
                              f"not {self.algorithm}")
        if self.lr_decay is not None and "lr_decay" not in can:
            raise self._lacks("lr_decay", "lr_decay", f"lr_decay is for {in_words(with_capability('lr_decay'))}, "
                              f"not {self.algorithm}")
        if self.dp_clip is None:
            given = [n for n in ("dp_noise_multiplier", "dp_epsilon", "dp_delta", "dp_noise_seed")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need dp_clip (the clip norm that turns DP on)")
        else:
            if "dp" not in can:
                raise self._lacks("dp", "differential privacy", f"differential privacy is for "
                                  f"{in_words(with_capability('dp'))}, not {self.algorithm}")
            if (self.dp_noise_multiplier is None) == (self.dp_epsilon is None):
                raise ValueError("DP needs exactly one of dp_noise_multiplier and dp_epsilon")
            if self.dp_epsilon is not None and self.dp_delta is None:
                raise ValueError("dp_epsilon needs dp_delta (e.g. 1e-5, below 1 / clients)")
            if self.dp_noise_multiplier == 0 and self.dp_delta is not None:  # its epsilon: inf, not JSON
                raise ValueError("dp_noise_multiplier 0 adds no noise, so no finite epsilon is spent: drop dp_delta "
                                 "(clipping only) or give a noise multiplier > 0")
            if self.aggregate != "mean" or self.weighted:
                raise ValueError("DP is accounted for the plain mean: use aggregate mean without weighted")
        self._secagg_checks()
        if self.step_norm is not None and "step_norm" not in can:
            raise self._lacks("step_norm", "step_norm", f"step_norm is for {in_words(with_capability('step_norm'))}, "
                              f"not {self.algorithm}")
        if self.step_norm is not None and self.local_steps > 1:
            raise ValueError("step_norm needs local_steps 1 (a local step cannot know its round's spread yet)")
        if self.momentum is not None and "momentum" not in can:
            raise self._lacks("momentum", "momentum", f"momentum is for {in_words(with_capability('momentum'))}, "
                              f"not {self.algorithm}")
        if self.scalar_dtype == "int8" and "int8" not in can:
            raise self._lacks("int8", "scalar_dtype int8", f"scalar_dtype int8 is for "
                              f"{in_words(with_capability('int8'))}, not {self.algorithm}")
        if self.scalar_dtype in ("int4", "int2", "sign") and "lowbit" not in can:
            raise self._lacks("lowbit", f"scalar_dtype {self.scalar_dtype}", f"scalar_dtype {self.scalar_dtype} is "
                              f"for {in_words(with_capability('lowbit'))}, not {self.algorithm}")
        if self.scalar_dtype in ("int4", "int2", "sign") and self.secagg:
            raise ValueError(f"scalar_dtype {self.scalar_dtype}: secure aggregation sums answers on its own grid; use "
                             "float32, float16, bfloat16 or int8 with it")
        if self.direction_refresh is not None and "refresh" not in can:
            raise self._lacks("refresh", "direction_refresh", f"direction_refresh reads the round from seeds derived "
                              f"per round: not for {self.algorithm}")
        if "one-seed" in can:
            self._one_seed_defaults()
        if self.directions in ("sparse", "lowrank") and "structured" not in can:
            raise self._lacks("structured", f"directions {self.directions}", f"{self.algorithm} draws its directions "
                              f"from a dense family, not {self.directions}")
        if self.weighted and "weighted" not in can:
            raise self._lacks("weighted", "weighted", f"{self.algorithm} runs with the plain mean only (no weighted "
                              "aggregation)")

    def _honour_checks(self) -> None:
        """Refuse an option whose capability the method declares but whose construction drops
        (:mod:`hiso.methods.honour`): the run would compute as without it while its files say otherwise."""
        from .methods.honour import unhonoured
        if (bad := unhonoured(self, self.zo())) is not None:
            cap, option, what = bad
            raise ValueError(f"{self.algorithm}: {option} {what} ({self.method.display} declares {cap!r} but does "
                             f"not honour it): refused")

    def _secagg_checks(self) -> None:
        """Secure aggregation gives the server the sum of the answers and nothing else: only the
        plain (unweighted) mean of hiso and decomfl can use it; its defaults are resolved here
        (and so recorded in config.json)."""
        if not self.secagg:
            given = [n for n in ("secagg_clip", "secagg_threshold", "secagg_shares") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only with secagg")
            return
        if "secagg" not in self.method.can:
            from .methods.registry import in_words, with_capability
            why = ("its majority vote counts +-1 per client, which a secure sum cannot check"
                   if self.sends_signs else "its server needs more than the plain sum")
            raise self._lacks("secagg", "secure aggregation", f"secure aggregation is for "
                              f"{in_words(with_capability('secagg'))}, not {self.algorithm}: {why}")
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
        shares = self.sampled if self.secagg_shares is None else self.secagg_shares
        if self.secagg_shares is not None and shares % 2 == 0:  # Flower's workflow would widen the ring to shares + 1 but split the secrets in shares
            raise ValueError(f"secagg_shares must be odd (a client and shares // 2 neighbours either side of it on "
                             f"a ring), got {shares}")
        if self.secagg_threshold is None:
            self.secagg_threshold = max(2, min(shares, self.sampled) // 2 + 1)
        if self.secagg_threshold > self.sampled:
            raise ValueError(f"secagg_threshold ({self.secagg_threshold}) cannot exceed sampled ({self.sampled})")
        if self.secagg_shares is not None and self.secagg_threshold >= shares:
            raise ValueError(f"secagg_threshold ({self.secagg_threshold}) must be below secagg_shares ({shares}), as "
                             "Flower's SecAgg+ requires")
        self.secagg_config.check_clients(self.sampled)

    @property
    def secagg_config(self):
        """The secure aggregation's grid and threshold (:class:`hiso.methods.secagg.SecAggConfig`), or None."""
        if not self.secagg:
            return None
        from .methods.secagg import SecAggConfig
        return SecAggConfig(self.secagg_clip, self.secagg_bits, self.secagg_modulus_bits, self.secagg_threshold)

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
        from .methods.registry import flag_options, option_groups
        flags = flag_options()  # another method's flags (nu on decomfl), not kept in the configuration
        out = {name: flags[name][1] for name in self._unused_flags}
        out.update({name: whose for names, _, whose in option_groups() if not all(map(self.method.reads, names))
                    for name in self.changed(names)})
        if self.step_norm is None and self.changed(["step_norm_beta"]):
            out["step_norm_beta"] = "with step_norm only"
        for names, off, whose in ((("byzantine_per_round", "attack", "attack_scale"), not self.byzantine,
                                   "with byzantine only"),
                                  (("trim",), self.aggregate != "trimmed-mean", "with aggregate trimmed-mean only"),
                                  (("secagg_bits", "secagg_modulus_bits"), not self.secagg, "with secagg only")):
            if off:
                out.update(dict.fromkeys(self.changed(names), whose))
        if self.sends_signs and self.byzantine:  # a random lie's scale cannot change its sign
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


@functools.lru_cache(maxsize=64)
def _solved_noise(eps: float, rounds: int, delta: float, clients: int, sampled: int, seed: int) -> float:
    from .methods.privacy import noise_for, planned_participations
    return noise_for(eps, planned_participations(seed, clients, sampled, rounds), delta)
