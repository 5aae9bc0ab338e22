"""The error of a tensor-parallel group that lost a rank."""


class RankLost(RuntimeError):
    """A rank of the group is gone: the model cannot run a step without it."""
