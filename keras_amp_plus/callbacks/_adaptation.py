"""The rule that moves layers between the allow and deny lists between epochs.

Evidence against a layer in one epoch is the number of overflow events
attributed to it: every forward overflow (the loss was Inf/NaN and the replay
named the layer) and every backward overflow that happened at a loss scale at or
below `trusted_backward_scale` (above it the scaler is still searching for its
scale, which is normal and is the scaler's business, not the layer's).
`AdaptationRule.evidence` is that count.

Evidence accumulates across epochs with a decay: each epoch end,
`score[layer] = evidence_decay * score[layer] + evidence[layer]`. At the
defaults (`deny_threshold=2`, `evidence_decay=0.7`) a layer with two events in
one epoch is denied at once, a layer with one event in each of three epochs in
a row is denied at the third (1 + 0.7 + 0.49 >= 2), and one event in a long run
never is (its score never exceeds 1). `evidence_decay=0` counts per epoch only.

At the end of each epoch:

```
for layer with score[layer] >= deny_threshold, not yet denied:
    deny it (float32 from the next epoch); denials[layer] += 1; score = 0
    wait[layer] = patience * 2 ** (denials[layer] - 1)     # hysteresis
for layer denied by this rule (never those the user denied):
    clean_epochs[layer] = clean_epochs[layer] + 1 if evidence[layer] == 0 else 0
    if denials[layer] <= max_retries and clean_epochs[layer] >= wait[layer]
            and no layer was moved back in the last `cooldown` epochs:
        move it back to low precision (allow list)
```

A layer that overflows again after being moved back is denied again and waits
twice as long; after `max_retries` returns it stays in float32.
"""

import dataclasses


@dataclasses.dataclass
class Decision:
    """One list change decided at the end of an epoch."""

    layer: str
    to: str
    reason: str
    evidence: dict


class AdaptationRule:
    """Decide list moves from per-epoch overflow evidence (see module doc).

    Args:
        deny_threshold: accumulated evidence against one layer (its attributed
            events at a trusted scale, decayed by `evidence_decay` at each
            epoch end) that moves it to the deny list. Defaults to `2`.
        patience: clean epochs a denied layer waits before it is tried in low
            precision again; doubled after each new denial. Defaults to `5`.
        cooldown: epochs after a layer is moved back during which no other layer
            is moved back, so new evidence points at one change. Defaults to `1`.
        max_retries: how many times a layer may be moved back; after that it
            stays denied. Defaults to `2`.
        evidence_decay: factor in [0, 1) applied to a layer's accumulated
            evidence at each epoch end. Defaults to `0.7`.
        trusted_backward_scale: backward overflows count as evidence only at a
            loss scale at or below this. Defaults to `1.0`.
    """

    def __init__(
        self,
        deny_threshold: int = 2,
        patience: int = 5,
        cooldown: int = 1,
        max_retries: int = 2,
        evidence_decay: float = 0.7,
        trusted_backward_scale: float = 1.0,
    ):
        self.deny_threshold = deny_threshold
        self.evidence_decay = evidence_decay
        self.trusted_backward_scale = trusted_backward_scale
        self.scores = {}
        self.patience = patience
        self.cooldown = cooldown
        self.max_retries = max_retries
        self.denials = {}
        self.clean_epochs = {}
        self.last_return_epoch = None

    def is_trusted(self, event) -> bool:
        """Return True when `event` is evidence against its layer (module doc)."""
        scale = event["scale_before"]
        return event["direction"] == "forward" or (
            scale is not None and scale <= self.trusted_backward_scale
        )

    def evidence(self, events) -> dict:
        """Count, per layer, the events of an epoch that speak against it."""
        counts = {}
        for event in events:
            if self.is_trusted(event):
                for layer in event["layers"]:
                    counts[layer] = counts.get(layer, 0) + 1
        return counts

    def accumulate(self, evidence: dict) -> dict:
        """Decay the accumulated scores and add the epoch's `evidence`."""
        scores = {
            layer: score * self.evidence_decay
            for layer, score in self.scores.items()
            if score * self.evidence_decay > 1e-3
        }
        for layer, count in evidence.items():
            scores[layer] = scores.get(layer, 0.0) + count
        self.scores = scores
        return scores

    def decide(self, epoch: int, evidence: dict, denied: set) -> list[Decision]:
        """Return the moves for the epoch that just ended.

        Args:
            epoch: the epoch that ended (0-based).
            evidence: `{layer: number of trusted attributed events}` for the
                epoch (`evidence(events)`).
            denied: the layer paths currently in float32 by any list.

        Example:
        >>> rule = AdaptationRule()
        >>> [d.to for d in rule.decide(0, {"dense": 2}, denied=set())]
        ['deny']
        """
        decisions = []
        scores = self.accumulate(evidence)
        for layer, score in sorted(scores.items()):
            if score >= self.deny_threshold - 1e-9 and layer not in denied:
                count = evidence.get(layer, 0)
                self.denials[layer] = self.denials.get(layer, 0) + 1
                self.clean_epochs[layer] = 0
                self.scores.pop(layer)
                decisions.append(
                    Decision(
                        layer,
                        "deny",
                        f"{count} overflow events in epoch {epoch}, accumulated "
                        f"evidence {score:.3g} (threshold {self.deny_threshold})",
                        {
                            "events": count,
                            "score": score,
                            "threshold": self.deny_threshold,
                        },
                    )
                )
        just_denied = {d.layer for d in decisions}
        for layer in sorted(self.denials):
            if layer in just_denied or layer not in denied:
                continue
            clean = 0 if evidence.get(layer, 0) else self.clean_epochs[layer] + 1
            self.clean_epochs[layer] = clean
            wait = self.wait_epochs(layer)
            if (
                self.denials[layer] <= self.max_retries
                and clean >= wait
                and self._cooled_down(epoch)
            ):
                self.last_return_epoch = epoch
                self.clean_epochs[layer] = 0
                decisions.append(
                    Decision(
                        layer,
                        "allow",
                        f"{clean} clean epochs in float32 (patience {wait})",
                        {"clean_epochs": clean, "patience": wait},
                    )
                )
        return decisions

    def wait_epochs(self, layer: str) -> int:
        """Clean epochs `layer` must wait in float32 before it may move back."""
        return self.patience * 2 ** (self.denials.get(layer, 1) - 1)

    def _cooled_down(self, epoch):
        if self.last_return_epoch is None:
            return True
        return epoch - self.last_return_epoch > self.cooldown

    def get_state(self) -> dict:
        """Return the rule's memory as JSON-serializable data."""
        return {
            "denials": dict(self.denials),
            "clean_epochs": dict(self.clean_epochs),
            "last_return_epoch": self.last_return_epoch,
            "scores": dict(self.scores),
        }

    def set_state(self, state: dict) -> None:
        """Restore the memory returned by `get_state`."""
        self.denials = dict(state.get("denials", {}))
        self.clean_epochs = dict(state.get("clean_epochs", {}))
        self.last_return_epoch = state.get("last_return_epoch")
        self.scores = dict(state.get("scores", {}))
