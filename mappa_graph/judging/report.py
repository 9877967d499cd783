"""How good is the judge? Agreement with outcomes, score spread per agent, bias probes.

The reference coach was biased (it scored regression tasks 0.5-1.8 points higher than classification) and the
agents learned to exploit it, so every run can be checked: `judge_report(store)` gives the AUROC of an
episode's mean action score against its success, per-agent score statistics, the correlation of score with
output length (length bias), the mean score by action position (position bias) and, with `group_by`, the mean
score per value of an episode metadata key (e.g. task type). Human corrections (overrides.py) take precedence
over the judge wherever it is compared with outcomes.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from ..capture.store import TraceStore
from .overrides import effective_rewards
from .protocol import ProcessJudge, score_all


# ---- statistics ---------------------------------------------------------------------------------------
def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Area under the ROC curve by the Mann-Whitney U statistic (ties count one half); None without both
    classes."""
    positives = sum(1 for y in labels if y)
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return None
    ranks = _ranks(scores)
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    return pearson(_ranks(xs), _ranks(ys))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# ---- the report ---------------------------------------------------------------------------------------
class ScorePoint(BaseModel):
    action_id: str
    episode_id: str
    agent: str
    index: int
    length: int
    score: float | None
    overridden: bool = False


class EpisodePoint(BaseModel):
    episode_id: str
    mean_score: float
    outcome: float
    success: bool


class AgentScoreStats(BaseModel):
    agent: str
    count: int
    scored: int
    unscored: int
    overridden: int = 0
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    q25: float | None = None
    median: float | None = None
    q75: float | None = None
    max: float | None = None
    length_spearman: float | None = None


class BiasProbe(BaseModel):
    n: int
    pearson: float | None = None
    spearman: float | None = None


class PositionStat(BaseModel):
    index: int
    count: int
    mean: float


class GroupStat(BaseModel):
    group: str
    count: int
    mean: float


class HumanAgreement(BaseModel):
    """The judge against human corrections, on the actions a human overrode with a score: how far apart they
    were (a judge that humans keep correcting by a lot is miscalibrated, whatever its AUROC)."""

    n: int = 0
    mean_abs_diff: float | None = None
    within_0_2: float | None = None  # share of overrides the judge was within 0.2 of
    pearson: float | None = None


class JudgeReport(BaseModel):
    """What `judge_report` measured; `to_table()` prints it, `save_plot(path)` draws it."""

    run: str | None = None
    judge: str | None = None
    episodes: int = 0
    actions: int = 0
    judged: int = 0
    scored: int = 0
    unscored: int = 0
    overrides: int = 0
    unscored_reasons: dict[str, int] = Field(default_factory=dict)
    success_threshold: float = 0.5
    labelled_episodes: int = 0
    successes: int = 0
    auroc: float | None = None
    agents: list[AgentScoreStats] = Field(default_factory=list)
    length_bias: BiasProbe = Field(default_factory=lambda: BiasProbe(n=0))
    position_bias: list[PositionStat] = Field(default_factory=list)
    position_spearman: float | None = None
    group_by: str | None = None
    groups: list[GroupStat] = Field(default_factory=list)
    human: HumanAgreement = Field(default_factory=HumanAgreement)
    points: list[ScorePoint] = Field(default_factory=list, repr=False)
    episode_points: list[EpisodePoint] = Field(default_factory=list, repr=False)

    def to_table(self) -> str:
        f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        where = f"run={self.run or 'all'} judge={self.judge or 'any'}"
        lines = [
            f"Judge report ({where})",
            f"episodes {self.episodes}  actions {self.actions}  judged {self.judged}  scored {self.scored}  "
            f"unscored {self.unscored}  human overrides {self.overrides}",
            f"AUROC of mean action score vs success (outcome >= {self.success_threshold:g}): {f(self.auroc)}  "
            f"[{self.labelled_episodes} labelled episodes, {self.successes} successes]",
        ]
        if self.unscored_reasons:
            lines.append("unscored reasons:")
            lines += [f"  {n:5d}  {why}" for why, n in sorted(self.unscored_reasons.items(), key=lambda kv: -kv[1])]
        head = f"{'agent':<16}{'n':>6}{'scored':>8}{'unsc.':>7}{'mean':>7}{'std':>7}{'min':>7}{'q25':>7}" \
               f"{'med':>7}{'q75':>7}{'max':>7}{'len-rho':>9}"
        lines += ["", head, "-" * len(head)]
        for a in self.agents:
            lines.append(f"{a.agent[:15]:<16}{a.count:>6}{a.scored:>8}{a.unscored:>7}{f(a.mean, 2):>7}"
                         f"{f(a.std, 2):>7}{f(a.min, 2):>7}{f(a.q25, 2):>7}{f(a.median, 2):>7}{f(a.q75, 2):>7}"
                         f"{f(a.max, 2):>7}{f(a.length_spearman, 2):>9}")
        lines += ["", f"length bias (score vs output chars, n={self.length_bias.n}): "
                      f"pearson {f(self.length_bias.pearson)}  spearman {f(self.length_bias.spearman)}"]
        positions = "  ".join(f"#{p.index}: {p.mean:.2f} (n={p.count})" for p in self.position_bias[:12])
        lines.append(f"position bias (mean score by action index; spearman {f(self.position_spearman)}): {positions}")
        if self.group_by:
            groups = "  ".join(f"{g.group}: {g.mean:.2f} (n={g.count})" for g in self.groups)
            lines.append(f"by {self.group_by}: {groups}")
        h = self.human
        lines.append(f"agreement with human overrides (n={h.n}): mean |judge - human| {f(h.mean_abs_diff)}  "
                     f"within 0.2 {f(h.within_0_2, 2)}  pearson {f(h.pearson)}")
        return "\n".join(lines)

    def save_plot(self, path: str | Path) -> Path:
        """Four panels (scores per agent, length vs score, score by position, ROC) as a PNG; no pyplot, so
        the caller's matplotlib backend is left alone."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scored = [p for p in self.points if p.score is not None]
        fig = Figure(figsize=(11, 8), layout="constrained")
        FigureCanvasAgg(fig)
        (ax_agent, ax_len), (ax_pos, ax_roc) = fig.subplots(2, 2)
        agents = [a.agent for a in self.agents if a.scored]
        if agents:
            ax_agent.boxplot([[p.score for p in scored if p.agent == name] for name in agents])
            ax_agent.set_xticks(range(1, len(agents) + 1), agents)
        ax_agent.set(title="score per agent", ylabel="score", ylim=(-0.05, 1.05))
        for name in agents:
            mine = [p for p in scored if p.agent == name]
            ax_len.scatter([p.length for p in mine], [p.score for p in mine], s=10, alpha=0.6, label=name)
        if agents:
            ax_len.legend(fontsize=8)
        ax_len.set(title=f"length bias (spearman {self.length_bias.spearman or 0:.2f})", xlabel="output characters",
                   ylabel="score")
        ax_pos.bar([p.index for p in self.position_bias], [p.mean for p in self.position_bias])
        ax_pos.set(title="position bias", xlabel="action index in episode", ylabel="mean score", ylim=(0, 1.05))
        positives = sum(e.success for e in self.episode_points)
        negatives = len(self.episode_points) - positives
        if positives and negatives:
            tpr, fpr = [0.0], [0.0]
            for threshold in sorted({e.mean_score for e in self.episode_points}, reverse=True):
                above = [e for e in self.episode_points if e.mean_score >= threshold]  # ties move together
                tpr.append(sum(e.success for e in above) / positives)
                fpr.append(sum(not e.success for e in above) / negatives)
            ax_roc.plot(fpr, tpr)
        ax_roc.plot([0, 1], [0, 1], linestyle="--", color="grey")
        auc = "-" if self.auroc is None else f"{self.auroc:.3f}"
        ax_roc.set(title=f"mean action score vs success (AUROC {auc})", xlabel="false positive rate",
                   ylabel="true positive rate")
        fig.savefig(path, dpi=100)
        return path


_WHERE = re.compile(r"^judge '.*?' could not score action \w+ \(node '.*?', agent '.*?'\): ")


def _reason_key(reason: str | None) -> str:
    text = _WHERE.sub("", reason or "no reason given")
    text = re.sub(r"\b[0-9a-f]{8,}\b", "<id>", text)
    return text if len(text) <= 90 else text[:87] + "..."


def judge_report(
    store: TraceStore,
    run: str | None = None,
    judge: str | ProcessJudge | None = None,
    *,
    success_threshold: float = 0.5,
    overrides: bool = True,
    group_by: str | None = None,
) -> JudgeReport:
    """Measure the judge on stored episodes. `judge` is a judge name (its stored rewards), None (the latest
    stored reward of any judge), or a judge object (scores the stored episodes now, writing nothing).
    Human overrides replace judge verdicts unless `overrides=False`."""
    episodes = store.episodes(run=run)
    if judge is None or isinstance(judge, str):
        if overrides:
            chosen = effective_rewards(store, run=run, judge=judge)
        else:  # the judge's own verdicts, even where a human overrode them
            chosen = {r.action_id: r for r in store.rewards(run=run)
                      if r.override_by is None and (judge is None or r.judge == judge)}
        judge_name = judge
    else:
        chosen = {r.action_id: r for r in score_all(judge, episodes)}
        if overrides:
            chosen.update({aid: r for aid, r in effective_rewards(store, run=run).items() if r.override_by})
        judge_name = judge.name
    report = JudgeReport(run=run, judge=judge_name, episodes=len(episodes), success_threshold=success_threshold,
                         group_by=group_by)
    reasons: Counter[str] = Counter()
    by_group: dict[str, list[float]] = defaultdict(list)
    for episode in episodes:
        report.actions += len(episode.actions)
        mine = []
        for action in episode.actions:
            reward = chosen.get(action.id)
            if reward is None:
                continue
            point = ScorePoint(action_id=action.id, episode_id=episode.id, agent=action.agent, index=action.index,
                               length=len(action.output_text), score=reward.score,
                               overridden=reward.override_by is not None)
            report.points.append(point)
            if reward.score is None:
                reasons[_reason_key(reward.unscored_reason)] += 1
            else:
                mine.append(reward.score)
        if mine and group_by is not None:
            by_group[str(episode.metadata.get(group_by, "(none)"))].extend(mine)
        if mine and episode.outcome is not None:
            report.episode_points.append(EpisodePoint(episode_id=episode.id, mean_score=sum(mine) / len(mine),
                                                      outcome=episode.outcome,
                                                      success=episode.outcome >= success_threshold))
    scored = [p for p in report.points if p.score is not None]
    report.judged, report.scored = len(report.points), len(scored)
    report.unscored = report.judged - report.scored
    report.overrides = sum(p.overridden for p in report.points)
    report.unscored_reasons = dict(reasons)
    report.labelled_episodes = len(report.episode_points)
    report.successes = sum(e.success for e in report.episode_points)
    report.auroc = auroc([e.mean_score for e in report.episode_points], [e.success for e in report.episode_points])
    for agent in dict.fromkeys(p.agent for p in report.points):
        pts = [p for p in report.points if p.agent == agent]
        values = sorted(p.score for p in pts if p.score is not None)
        stats = AgentScoreStats(agent=agent, count=len(pts), scored=len(values), unscored=len(pts) - len(values),
                                overridden=sum(p.overridden for p in pts))
        if values:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
            stats = stats.model_copy(update=dict(
                mean=mean, std=std, min=values[0], q25=_quantile(values, 0.25), median=_quantile(values, 0.5),
                q75=_quantile(values, 0.75), max=values[-1],
                length_spearman=spearman([p.length for p in pts if p.score is not None],
                                         [p.score for p in pts if p.score is not None])))
        report.agents.append(stats)
    lengths, values = [float(p.length) for p in scored], [p.score for p in scored]
    report.length_bias = BiasProbe(n=len(scored), pearson=pearson(lengths, values), spearman=spearman(lengths, values))
    by_index: dict[int, list[float]] = defaultdict(list)
    for p in scored:
        by_index[p.index].append(p.score)  # type: ignore[arg-type]
    report.position_bias = [PositionStat(index=i, count=len(v), mean=sum(v) / len(v)) for i, v in sorted(by_index.items())]
    report.position_spearman = spearman([float(p.index) for p in scored], values)  # type: ignore[arg-type]
    report.groups = [GroupStat(group=g, count=len(v), mean=sum(v) / len(v)) for g, v in sorted(by_group.items())]
    report.human = human_agreement(store, run=run, judge=judge_name)
    return report


def human_agreement(store: TraceStore, *, run: str | None = None, judge: str | None = None) -> HumanAgreement:
    """The judge's own latest verdict against the latest human score, on every action a human scored."""
    judged: dict[str, float] = {}
    human: dict[str, float] = {}
    for reward in store.rewards(run=run):
        if reward.score is None:
            continue
        if reward.override_by is not None:
            human[reward.action_id] = reward.score
        elif judge is None or reward.judge == judge:
            judged[reward.action_id] = reward.score
    pairs = [(judged[a], human[a]) for a in human if a in judged]
    if not pairs:
        return HumanAgreement()
    diffs = [abs(j - h) for j, h in pairs]
    return HumanAgreement(n=len(pairs), mean_abs_diff=sum(diffs) / len(diffs),
                          within_0_2=sum(d <= 0.2 + 1e-9 for d in diffs) / len(diffs),
                          pearson=pearson([j for j, _ in pairs], [h for _, h in pairs]))
