"""A KV-cache eviction policy as a plug-in (docs/policies.md): MIXSCOPE_POLICIES=docs/examples/scissorhands_policy.py
puts it on the Pruning and Generate pages and in the reports' --policies. tests/test_policy_plugin.py runs it."""
import torch

from models.pruning import policies


@policies.register
class Scissorhands(policies.Policy):
    """After Liu et al., "Scissorhands" (arXiv 2305.17118), simplified: a token the current query attends to less
    than the average (1 / tokens held, over the row's heads) earns a strike; over the budget, evict the token with
    the most strikes outside the `recent` newest (ties: the earlier slot)."""
    name = "scissorhands"
    title = "Scissorhands per KV group (strikes for low attention)"
    per_group = True
    uses_attention = True
    modes = ("step",)

    def __init__(self, budget, mode=None, recent=8):
        super().__init__(budget, mode)
        self.recent = min(recent, budget - 1)

    def state(self, rows, capacity, device):
        return {"strikes": torch.zeros(rows, capacity, device=device)}

    def step(self, live, pos, q_pos, probs=None, state=None):
        strikes = state["strikes"][:, :live.shape[1]]
        strikes += (live & (probs.mean(1) < 1.0 / live.sum(1, keepdim=True))).float()   # in place: kept
        old = live & (pos <= q_pos[:, None] - self.recent)
        return policies.evict_lowest(live, -strikes, old, live.sum(1) - self.budget)
