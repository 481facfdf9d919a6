"""The swift demo's reward (``--reward_funcs m2po_demo_code_points``), loaded with ``--external_plugins``:
the sum of a completion's code points modulo 5, over 4 (deterministic; random bytes decode to many U+FFFD, so a
share of characters would give most groups equal rewards and zero advantages)."""

from swift.rewards import ORM, orms


class CodePointsModFive(ORM):
    def __call__(self, completions, **kwargs):
        return [(sum(map(ord, text)) % 5) / 4 for text in completions]


orms["m2po_demo_code_points"] = CodePointsModFive
