"""Whole synthetic meetings: the design team of synthetic.py at a real meeting's length, facts spread through it.

A meeting's transcript length is drawn log-normal (median ~6,000 tokens, a tail to ~30,000, as AMI meetings run),
and filled with discussion, presentations, back-channels and small talk. Its facts (decisions, action items with
an owner and a calendar date, figures such as budgets and counts) are exchanges of a few turns placed at random
among those filler turns, spread over the four quarters of the meeting, so a model that reads only the head and
tail of a transcript misses most of them. The summary states every fact; `Meeting.facts` lists their key strings.

Lengths are planned in characters, at ``CHARS_PER_TOKEN``. Measured on 300 meetings' transcripts: SmolLM2's
tokenizer (a 49k-token byte-level BPE, like Qwen3's 151k one trained on English web text) reads 4.04 characters a
token (median 6,270 tokens), the demo tokenizer (2,048 tokens, trained on the short meetings) 3.74 (median 6,810);
3.9 lands both within 5% of the planned median.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from pipetune.data.facts import Fact
from pipetune.data.synthetic import (
    FILLER_SLOT,
    LEAD_FILLERS,
    MID_FILLERS,
    NAMES,
    OPTIONS,
    PROJECT_MANAGER,
    ROLES,
    SAY,
    TASKS,
    TOPICS,
    ActionItem,
    Meeting,
    Option,
    Turn,
    action_fact,
    action_turns,
    decision_fact,
    decision_units,
    fill_template,
    join_words,
    say_line,
    template_sections,
)

MEDIAN_TOKENS = 6000
"""Median transcript length in tokens."""
LOG_SIGMA = 0.6
"""Spread of the log-normal: 95% of meetings between ~1,850 and ~19,500 tokens."""
MIN_TOKENS, MAX_TOKENS = 1000, 30000
"""Lengths are drawn log-normal and clipped to this range."""
CHARS_PER_TOKEN = 3.9
"""Characters of these transcripts per token (measured; see the module docstring)."""
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")  # fmt: skip


@dataclass(frozen=True)
class Figure:
    """A number the meeting settles, e.g. the marketing budget of 40,000 euros."""

    subject: str
    """What the number is, as the summary names it: "marketing budget"."""
    value: str
    """As written, with thousands separators: "40,000", "12.50"."""
    unit: str
    """"euros", "units", ... or "" for a plain count."""


@dataclass(frozen=True)
class WholeMeetingPlan:
    """The facts of one whole meeting and its length, fixed before any wording is chosen."""

    topic: str
    participants: tuple[tuple[str, str], ...]
    decisions: tuple[Option, ...]
    rejected: tuple[Option, ...]
    action_items: tuple[ActionItem, ...]
    """Deadlines are calendar dates, "14 March" (date_forms gives the ways they are said)."""
    figures: tuple[Figure, ...]
    target_tokens: int
    """The transcript's planned length in tokens (CHARS_PER_TOKEN characters each)."""
    render_seed: int


# subject | unit | smallest value | largest | step (values are multiples of the step)
_FIGURE_TABLE = """
marketing budget | euros | 20000 | 80000 | 5000
production budget | euros | 100000 | 400000 | 25000
production cost target | euros per unit | 8 | 14 | 0.5
first production run | units | 5000 | 50000 | 2500
sales target | remotes in the first year | 100000 | 900000 | 50000
focus group size | people | 12 | 60 | 4
battery life target | months | 6 | 36 | 6
weight limit | grams | 80 | 200 | 10
maximum number of buttons | | 8 | 24 | 1
"""
_FIGURES = [row.split("|") for row in _FIGURE_TABLE.strip().splitlines()]


def date_forms(date: str) -> tuple[str, ...]:
    """The ways a deadline "14 March" is said and written: 14 March, March 14, March 14th, the 14th of March."""
    day, month = date.split()
    suffix = "th" if 10 <= int(day) % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(int(day) % 10, "th")
    return (date, f"{month} {day}", f"{month} {day}{suffix}", f"the {day}{suffix} of {month}")


def date_keys(date: str) -> tuple[str, ...]:
    """The forms a summary may write a deadline in: date_forms' and 14th March, 14th of March, Mar 14, 14 Mar,
    Mar 14th."""
    day, month = date.split()
    ordinal = date_forms(date)[2].split()[1]
    short = month[:3]
    extra = (f"{ordinal} {month}", f"{ordinal} of {month}", f"{short} {day}", f"{day} {short}", f"{short} {ordinal}")
    return (*date_forms(date), *extra)


def figure_fact(figure: Figure) -> Fact:
    """A figure is stated by its subject and its value (separators and trailing zeros aside)."""
    text = f"The {figure.subject} is {figure.value} {figure.unit}".rstrip() + "."
    return Fact("figure", text, ((figure.subject,), (figure.value,)))


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def _draw_tokens(rng: random.Random) -> int:
    return min(max(round(MEDIAN_TOKENS * math.exp(rng.gauss(0, LOG_SIGMA))), MIN_TOKENS), MAX_TOKENS)


def _draw_figure(rng: random.Random, row: list[str]) -> Figure:
    subject, unit, low, high, step = (cell.strip() for cell in row)
    value = float(low) + float(step) * rng.randint(0, round((float(high) - float(low)) / float(step)))
    written = f"{value:,.2f}" if value % 1 else f"{value:,.0f}"
    return Figure(subject, written, unit)


def _plan_whole_meeting(rng: random.Random) -> WholeMeetingPlan:
    target_tokens = _draw_tokens(rng)
    longer = (target_tokens > 8000) + (target_tokens > 16000)  # longer meetings settle more
    names = dict(zip(ROLES, rng.sample(NAMES, len(ROLES)), strict=True))
    decisions, rejected = [], []
    for subject in rng.sample(list(OPTIONS), rng.randint(2, 4) + longer):
        chosen, alternative = rng.sample(OPTIONS[subject], 2)
        decisions.append(chosen)
        rejected.append(alternative)
    things = [option.thing for option in decisions if option.subject != "the price"]
    tasks = [(role, task) for role in ROLES for task in TASKS[role] if things or "{thing}" not in task]
    action_items = []
    for role, template in rng.sample(tasks, rng.randint(2, 4) + longer):  # distinct tasks, anyone's
        task = template.format(thing=rng.choice(things) if things else "")
        date = f"{rng.randint(1, 28)} {rng.choice(MONTHS)}"
        action_items.append(ActionItem(role, names[role], task, date))
    figures = [_draw_figure(rng, row) for row in rng.sample(_FIGURES, rng.randint(2, 4))]
    return WholeMeetingPlan(
        topic=rng.choice(TOPICS),
        participants=tuple(names.items()),
        decisions=tuple(decisions),
        rejected=tuple(rejected),
        action_items=tuple(action_items),
        figures=tuple(figures),
        target_tokens=target_tokens,
        render_seed=rng.getrandbits(64),
    )


def plan_whole_meetings(n: int, seed: int = 0) -> list[WholeMeetingPlan]:
    """The facts and lengths behind ``generate_whole_meetings(n, seed)``, meeting by meeting."""
    if n < 0:
        raise ValueError(f"n={n} is negative; ask for zero or more meetings")
    rng = random.Random(seed)
    return [_plan_whole_meeting(random.Random(rng.getrandbits(64))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

# What fills a whole meeting between its facts. Lines hold no figures or dates, so that every number in a
# transcript belongs to a fact (or to a rejected alternative).
_WHOLE_PHRASEBOOK = """
[discussion]
{F}I think the main thing is that it has to be easy to use.
{F}can you go back to the previous slide for a second?
{F}we should really keep the user in mind here,{f}not just the technology.
{F}I'm not sure the management will go for that.
{F}that's a fair point, actually.
{F}I was thinking about this on the way in, and{f}I'm not convinced yet.
{F}what did the users say about that in the questionnaire?
{F}let's not spend too long on this, we still have a lot to cover.
{F}maybe we can come back to that later.
{F}I agree with what was said before.
{F}it depends a bit on what the engineers come back with.
{F}the trend watchers say fancy and trendy is the most important thing right now.
{F}we want something that people actually recognise as our product.
{F}the older users mostly want it to be simple.
{F}I wrote that down, we can look at it again next time.
{F}I think we're going in circles a bit.
{F}does anyone have anything to add to that?
{F}I can ask around in the other teams as well.
{F}my worry is that it gets too complicated for the average user.
{F}the competitors all do more or less the same thing, so{f}we need something that stands out.
{F}we should also think about how it looks in the shop.
{F}I'll put that in my notes.
{F}let me just finish this point first.
{F}that was in the report from last week, I think.
{F}I'd like to hear what the others think.
{F}it also has to survive being dropped on the floor a few times.
{F}the young people in the study mostly watch TV in the evening.
{F}people told us they spend a lot of time looking for the right button.
{F}it should feel nice in the hand, that's really important.
{F}we shouldn't forget the teletext function, though.
{F}I'm fine either way, to be honest.
{F}can we get some samples to try?
[presentation]
So, I've prepared a few slides on this.
The first thing I looked at was how people actually use their remote at home.
Most of them only use a handful of buttons, like the volume and the channels.
The rest of the buttons are basically never touched.
I also looked at what the competitors are doing.
Their remotes look very similar, mostly grey and black, quite boring.
Another thing that came up is that people want it to be easy to find.
From the technical side, the components are mostly standard.
The case and the chip are the parts that decide the cost.
We have some freedom in the shape, but not unlimited.
The engineers told me the more curved it is, the more expensive it gets.
So, um, that's basically my findings.
On the next slide you can see the main functions.
I think these are the things we should focus on.
My personal preference would be to keep it simple.
[digression]
{F}did anyone watch the match last night? / {F}no, I missed it. Was it any good? / {F}it was terrible, they lost again.
{F}is it just me, or is it really cold in here? / {F}yeah, the heating is off again. / Hmm.
{F}sorry, can you hear that noise? / {F}I think they're drilling next door. / Typical.
{F}are we having the team drinks on Friday? / {F}I think so, yeah. / {F}good, I need it.
"""
_WHOLE = template_sections(_WHOLE_PHRASEBOOK)
_FIGURE_LINES = (
    "{F}just so everyone knows, the {subject} is {amount}.",
    "{F}I checked with management:{f}the {subject} is {amount}.",
    "{F}for the record, we've fixed the {subject} at {amount}.",
    "{F}the numbers came in, and the {subject} will be {amount}.",
)
_FIGURE_QUESTIONS = ("{F}do we know the {subject} yet?", "{F}what about the {subject}, is that settled?")
_FIGURE_REPLIES = (
    "{F}okay, {amount}. Noted.",
    "{F}good, that's clear then.",
    "Mm-hmm.",
    "{F}that's more than I thought.",
)


def _figure_unit(figure: Figure, rng: random.Random, said_by: str) -> list[Turn]:
    amount = f"{figure.value} {figure.unit}".rstrip()
    turns: list[Turn] = []
    if rng.random() < 0.4:
        turns.append((None, fill_template(rng, rng.choice(_FIGURE_QUESTIONS), subject=figure.subject)))
    turns.append((said_by, fill_template(rng, rng.choice(_FIGURE_LINES), subject=figure.subject, amount=amount)))
    turns.append((None, fill_template(rng, rng.choice(_FIGURE_REPLIES), amount=amount)))
    return turns


# Filler is most of a whole meeting's text, so its lines are prepared once: each template with its facts filled in
# and split at its filler slots ({F}, {f}), to be joined with fillers drawn per use.
_Parts = tuple[str, ...]


def _parts(template: str, **facts: str) -> _Parts:
    return tuple(FILLER_SLOT.split(template.replace("{F}", "{{F}}").replace("{f}", "{{f}}").format(**facts)))


def _exchanges(option: Option) -> list[list[_Parts]]:
    return [
        [_parts(line, thing=option.thing, con=con) for line in template.split(" / ")]
        for template in SAY["alternative"]
        for con in SAY["con"]
    ]


_DISCUSSION = [_parts(line) for line in _WHOLE["discussion"]] + [
    _parts(line, subject=subject) for line in SAY["comment"] for subject in OPTIONS
]
_BACKCHANNELS = SAY["backchannel"]
_PRESENTATION = _WHOLE["presentation"]
_ALTERNATIVES = {option: _exchanges(option) for options in OPTIONS.values() for option in options}
_SUBJECTS = list(OPTIONS)
_FILLER_KINDS = ("discussion",) * 8 + ("backchannel",) * 3 + ("presentation",) * 2 + ("alternative",)
"""Kinds of filler unit, each as often as it is drawn."""


def _said(parts: _Parts, draw: Callable[[], float]) -> str:
    """A prepared line with a filler drawn for each slot (as synthetic.fill_template does)."""
    if len(parts) == 1:
        return parts[0]
    pieces = [parts[0]]
    for i in range(1, len(parts), 2):
        fillers = LEAD_FILLERS if parts[i] == "F" else MID_FILLERS
        pieces += (fillers[int(draw() * len(fillers))], parts[i + 1])
    text = "".join(pieces).replace(",,", ",")
    return text[0].upper() + text[1:]


def _filler_unit(plan: WholeMeetingPlan, draw: Callable[[], float]) -> list[Turn]:
    kind = _FILLER_KINDS[int(draw() * len(_FILLER_KINDS))]
    if kind == "discussion":
        return [(None, _said(_DISCUSSION[int(draw() * len(_DISCUSSION))], draw))]
    if kind == "backchannel":
        return [(None, _BACKCHANNELS[int(draw() * len(_BACKCHANNELS))])]
    if kind == "presentation":
        start = int(draw() * len(_PRESENTATION))
        return [(None, " ".join(_PRESENTATION[start : start + 3 + int(draw() * 5)]))]
    # An idea raised and turned down: for a decided subject its rejected option, never the decided one.
    subject = _SUBJECTS[int(draw() * len(_SUBJECTS))]
    rejected = [option for option in plan.rejected if option.subject == subject]
    options = rejected or OPTIONS[subject]
    exchanges = _ALTERNATIVES[options[int(draw() * len(options))]]
    return [(None, _said(parts, draw)) for parts in exchanges[int(draw() * len(exchanges))]]


def _speakers(turns: list[Turn], rng: random.Random) -> list[str]:
    """Open turns go to someone other than the previous and the next speaker."""
    others = {(a, b): [r for r in ROLES if r not in (a, b)] for a in (*ROLES, None) for b in (*ROLES, None)}
    speakers: list[str] = []
    previous = None
    draw = rng.random
    for i, (role, _) in enumerate(turns):
        if role is None:
            candidates = others[previous, turns[i + 1][0] if i + 1 < len(turns) else None]
            role = candidates[int(draw() * len(candidates))]
        speakers.append(role)
        previous = role
    return speakers


def _render_transcript(plan: WholeMeetingPlan, rng: random.Random) -> str:
    names = dict(plan.participants)
    fact_units: list[list[Turn]] = []
    for option in plan.decisions:
        fact_units.append([turn for unit in decision_units(option, rng) for turn in unit])
    for item in plan.action_items:
        said = ActionItem(item.role, item.name, item.task, "by " + rng.choice(date_forms(item.deadline)))
        fact_units.append(action_turns(said, rng))
    for figure in plan.figures:
        fact_units.append(_figure_unit(figure, rng, rng.choice(ROLES)))
    rng.shuffle(fact_units)

    subjects = join_words([option.subject for option in plan.decisions])
    opening = [(PROJECT_MANAGER, say_line(rng, "opening", topic=plan.topic, subjects=subjects))]
    closing = [(PROJECT_MANAGER, say_line(rng, "closing"))]
    prefix = sum(len(role) + len(name) + 5 for role, name in plan.participants) / len(plan.participants)
    # Characters, each turn's "Role (Name): " included but not its newline: transcripts come out ~1.4% longer than
    # target_tokens (median); left so, so that a seed draws the meetings it always drew (measured runs use them).
    budget = plan.target_tokens * CHARS_PER_TOKEN
    budget -= sum(len(text) + prefix for unit in fact_units + [opening, closing] for _, text in unit)

    fillers: list[list[Turn]] = []
    n_digressions, draw = 0, rng.random
    while budget > 0:
        if n_digressions < 2 and draw() < 0.01:
            n_digressions += 1
            unit = [(None, fill_template(rng, line)) for line in rng.choice(_WHOLE["digression"]).split(" / ")]
        else:
            unit = _filler_unit(plan, draw)
        fillers.append(unit)
        for _, text in unit:
            budget -= len(text) + prefix

    # Fact i goes into quarter i mod 4 of the filler turns, at a random place inside it (a margin from the edges, so
    # that the few fact turns ahead of it cannot push it into the next quarter): every quarter gets facts.
    starts = [0]  # filler turns before each unit, and in all
    for unit in fillers:
        starts.append(starts[-1] + len(unit))
    slots: list[list[list[Turn]]] = [[] for _ in starts]
    for i, unit in enumerate(fact_units):
        quarter = i % 4
        low, high = (quarter + 0.05) * starts[-1] / 4, (quarter + 0.95) * starts[-1] / 4
        slots[bisect.bisect_left(starts, low + (high - low) * rng.random())].append(unit)
    body: list[Turn] = []
    for i, filler in enumerate([*fillers, []]):
        for unit in slots[i]:
            body += unit
        body += filler
    turns = opening + body + closing
    speakers = _speakers(turns, rng)
    return "\n".join(f"{role} ({names[role]}): {text}" for role, (_, text) in zip(speakers, turns, strict=True))


def _render_summary(plan: WholeMeetingPlan, rng: random.Random, date_form: int) -> str:
    subjects = join_words([option.subject for option in plan.decisions])
    sentences = [
        rng.choice(SAY["summary opening with subjects"]).format(topic=plan.topic, subjects=subjects),
        rng.choice(SAY["summary decisions"]).format(phrases=join_words([o.phrase for o in plan.decisions])),
        "Figures: " + "; ".join(f"the {f.subject} is {f.value} {f.unit}".rstrip() for f in plan.figures) + ".",
    ]
    items = [f"{i.name} ({i.role}) will {i.task} by {date_forms(i.deadline)[date_form]}" for i in plan.action_items]
    sentences.append("Action items: " + "; ".join(items) + ".")
    return " ".join(sentences)


def whole_meeting_facts(plan: WholeMeetingPlan) -> tuple[Fact, ...]:
    """Every fact of the meeting: its decisions, action items (any date form) and figures."""
    actions = [action_fact(item, date_keys(item.deadline)) for item in plan.action_items]
    return (*map(decision_fact, plan.decisions), *actions, *map(figure_fact, plan.figures))


def render_whole_meeting(plan: WholeMeetingPlan) -> Meeting:
    """Word a planned whole meeting: its transcript of about ``plan.target_tokens`` tokens, summary and facts."""
    rng = random.Random(plan.render_seed)
    date_form = rng.randrange(2)  # the summary writes dates as "14 March" or as "March 14"
    transcript = _render_transcript(plan, rng)
    return Meeting(transcript, _render_summary(plan, rng, date_form), facts=whole_meeting_facts(plan))


def generate_whole_meetings(n: int, seed: int = 0) -> list[Meeting]:
    """``n`` whole meetings; the same arguments give the same meetings, and the first k do not depend on n."""
    return [render_whole_meeting(plan) for plan in plan_whole_meetings(n, seed)]
