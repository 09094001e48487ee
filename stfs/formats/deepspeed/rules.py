"""A DeepSpeed ZeRO checkpoint's rule errors (SPEC §16, docs/deepspeed.md)."""

from __future__ import annotations

from ...errors import RuleError


class DeepSpeedError(RuleError):
    """A DeepSpeed ZeRO checkpoint is refused (SPEC §16): its rank files break a rule.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid checkpoint"
    format_name = "DeepSpeed ZeRO checkpoint"
    advice = "load it with DeepSpeed to see what it says, or save it again with engine.save_checkpoint"


class NotZeroCheckpoint(DeepSpeedError):
    """The file is not what ``engine.save_checkpoint`` writes (a ``latest`` that names no tag folder, a model state
    without ``param_shapes``): not a DeepSpeed checkpoint at all."""

    rule_text = "checkpoint"
    advice = "mount a tag folder engine.save_checkpoint wrote (global_stepN/), or the folder whose latest names one"
    refutes_format = True  # a folder's other file named so is left in files/, not a model


class MissingRankFile(DeepSpeedError):
    """A rank's model or optimizer state file is not in the tag folder."""

    rule_text = "a file for every rank"
    advice = "copy every rank's *_model_states.pt and *_optim_states.pt of the tag folder beside each other"


class RanksDisagree(DeepSpeedError):
    """Two ranks' files say different things about the run (world size, ZeRO stage, parameter groups), or there are
    more rank files than the world size."""

    rule_text = "ranks that agree"
    advice = "mount one run's tag folder alone: every rank file of one save_checkpoint, no other run's"


class PartitionTooShort(DeepSpeedError):
    """A rank's flat partitions end before the parameters they must hold (or hold more than padding explains)."""

    rule_text = "partitions that hold their parameters"
    advice = "copy the rank files again whole: each rank's flat partitions were cut or mixed with another run's"


class InvalidRankState(DeepSpeedError):
    """A member of a rank's state is not what DeepSpeed writes there (a flat partition that is not a 1-D float32
    tensor, a parameter shape that is not integers)."""

    rule_text = "rank state"


class ModelParallelCheckpoint(DeepSpeedError):
    """The checkpoint is tensor- or pipeline-parallel (``mp_rank_01`` and above): its parameters are split in ways
    the files do not describe alone."""

    rule_text = "data-parallel checkpoint"
    advice = "merge the model-parallel ranks first (Megatron's or DeepSpeed's own tools), then mount the merged run"
