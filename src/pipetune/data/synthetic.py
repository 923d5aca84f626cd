"""Deterministic synthetic meeting corpus in the style of the AMI remote-control scenario.

A four-person team (Project Manager, Marketing Expert, User Interface Designer, Industrial
Designer) designs a TV remote control. Every meeting agrees on 1-3 decisions and assigns 1-3
action items; the reference summary restates exactly those facts, and each fact appears word for
word in the transcript, so a small model can learn the mapping without any download.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from pipetune.data.example import Example
from pipetune.data.facts import Fact

ROLES = ("Project Manager", "Marketing Expert", "User Interface Designer", "Industrial Designer")
PROJECT_MANAGER = ROLES[0]
NAMES = (
    "Anna", "Bert", "Cleo", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Karin", "Liam",
    "Maya", "Nils", "Olga", "Pieter", "Quinn", "Rosa", "Sven", "Tara", "Ugo", "Vera", "Wim", "Yara",
)  # fmt: skip
TOPICS = ("kick-off", "functional design", "conceptual design", "detailed design")
DEADLINES = (
    "by Friday", "before the next meeting", "by Wednesday", "tomorrow morning", "by the end of the week",
    "by Monday", "by Thursday afternoon", "after lunch", "by the end of the day",
)  # fmt: skip
MIN_TURNS = 7
"""Fewest turns that hold an opening, one decision, one action item and a closing."""


Meeting = Example
"""A generated meeting: speaker-tagged turns (``Role (Name): text``), a short paragraph stating its
decisions and action items as the summary, and those facts (``facts``) with the strings that state them."""


@dataclass(frozen=True)
class Option:
    """A design choice the team can agree on."""

    subject: str
    """What is being decided, e.g. "the case"."""
    thing: str
    """The choice as a noun phrase, e.g. "a rubber case"."""
    phrase: str
    """The decision as a verb phrase, e.g. "use a rubber case"."""


@dataclass(frozen=True)
class ActionItem:
    """A task assigned to one participant, with a deadline."""

    role: str
    name: str
    task: str
    deadline: str


@dataclass(frozen=True)
class MeetingPlan:
    """The facts of one meeting, fixed before any wording is chosen."""

    topic: str
    participants: tuple[tuple[str, str], ...]
    """(role, name) pairs in ``ROLES`` order."""
    decisions: tuple[Option, ...]
    rejected: tuple[Option, ...]
    """One alternative per decision, which the discussion may raise and turn down."""
    action_items: tuple[ActionItem, ...]
    n_turns: int
    render_seed: int


# subject | the choice as spoken | the decision as a verb phrase
_OPTION_TABLE = """
the case | a rubber case | use a rubber case
the case | a plastic case | use a hard plastic case
the case | a titanium case | make the case out of titanium
the case | a wooden case | go for a wooden case
the shape | a curved shape | go with a curved shape
the shape | a double-curved shape | make it double-curved
the shape | a flat rectangular shape | keep a flat rectangular shape
the shape | a banana shape | give it a banana shape
the power source | a kinetic battery | use a kinetic battery
the power source | standard AA batteries | run it on standard AA batteries
the power source | a solar cell | add a solar cell
the power source | a docking station | add a charging docking station
the price | a price of 25 euros | set a target price of 25 euros
the price | a price of 20 euros | sell it for 20 euros
the price | a price of 30 euros | set the price at 30 euros
the price | a price of 18 euros | keep the price at 18 euros
the display | an LCD screen | include an LCD screen
the display | a small touch screen | add a small touch screen
the display | no display at all | leave out the display
the controls | voice recognition | add voice recognition
the controls | a scroll wheel | put in a scroll wheel
the controls | a touch pad | use a touch pad instead of buttons
the controls | large push buttons | keep large push buttons
the controls | a joystick | use a joystick for the menu
the colours | the company colours yellow and black | use the company colours yellow and black
the colours | bright fruity colours | go for bright fruity colours
the colours | a silver and grey finish | give it a silver and grey finish
the extra features | glow-in-the-dark buttons | make the buttons glow in the dark
the extra features | a locator beep | include a locator beep
the extra features | a built-in clock | add a built-in clock
the chip | a simple chip | use a simple chip
the chip | a regular chip | go with a regular chip
the chip | an advanced chip | use an advanced chip on print
"""
# role | a task that role takes on; {thing} is one of the meeting's decided things
_TASK_TABLE = """
Project Manager | send round the minutes
Project Manager | update the project budget
Project Manager | email the board about {thing}
Project Manager | book a room for the next meeting
Marketing Expert | check the market research on {thing}
Marketing Expert | run a quick survey among younger users
Marketing Expert | find out what competitors charge
Marketing Expert | prepare the trend report
User Interface Designer | draw up a sketch of the button layout
User Interface Designer | test {thing} with a few users
User Interface Designer | work out the menu structure
User Interface Designer | make a mock-up of the interface
Industrial Designer | look into the cost of {thing}
Industrial Designer | ask the engineers about {thing}
Industrial Designer | build a first prototype
Industrial Designer | check the parts list with manufacturing
"""


def _rows_by_first_cell(table: str) -> dict[str, list[list[str]]]:
    rows: dict[str, list[list[str]]] = {}
    for line in table.strip().splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        rows.setdefault(cells[0], []).append(cells)
    return rows


OPTIONS = {subject: [Option(*row) for row in rows] for subject, rows in _rows_by_first_cell(_OPTION_TABLE).items()}
"""Design choices by subject."""
TASKS = {role: [task for _, task in rows] for role, rows in _rows_by_first_cell(_TASK_TABLE).items()}
"""Tasks by role; "{thing}" stands for one of the meeting's decided things."""


# ---------------------------------------------------------------------------------------------
# Planning: which facts a meeting has
# ---------------------------------------------------------------------------------------------


def _core_turns(n_decisions: int, n_actions: int) -> int:
    # opening + (proposal, response, agreement) per decision + two turns per action item + closing
    return 2 + 3 * n_decisions + 2 * n_actions


def _plan_meeting(rng: random.Random, min_turns: int, max_turns: int) -> MeetingPlan:
    n_turns = rng.randint(min_turns, max_turns)
    n_decisions, n_actions = rng.randint(1, 3), rng.randint(1, 3)
    while _core_turns(n_decisions, n_actions) > n_turns:
        if n_decisions >= n_actions:
            n_decisions -= 1
        else:
            n_actions -= 1
    names = dict(zip(ROLES, rng.sample(NAMES, len(ROLES)), strict=True))
    decisions, rejected = [], []
    for subject in rng.sample(list(OPTIONS), n_decisions):
        chosen, alternative = rng.sample(OPTIONS[subject], 2)
        decisions.append(chosen)
        rejected.append(alternative)
    # A task can be about any decided thing except a price ("look into the cost of a price" reads badly).
    things = [option.thing for option in decisions if option.subject != "the price"]
    action_items = []
    for role in rng.sample(ROLES, n_actions):
        tasks = [task for task in TASKS[role] if things or "{thing}" not in task]
        task = rng.choice(tasks).format(thing=rng.choice(things) if things else "")
        action_items.append(ActionItem(role, names[role], task, rng.choice(DEADLINES)))
    return MeetingPlan(
        topic=rng.choice(TOPICS),
        participants=tuple(names.items()),
        decisions=tuple(decisions),
        rejected=tuple(rejected),
        action_items=tuple(action_items),
        n_turns=n_turns,
        render_seed=rng.getrandbits(64),
    )


def plan_meetings(n: int, seed: int = 0, min_turns: int = 12, max_turns: int = 40) -> list[MeetingPlan]:
    """The facts behind ``generate_meetings(n, seed, ...)``, meeting by meeting."""
    if n < 0:
        raise ValueError(f"n={n} is negative; ask for zero or more meetings")
    if not MIN_TURNS <= min_turns <= max_turns:
        raise ValueError(
            f"min_turns={min_turns}, max_turns={max_turns}: need {MIN_TURNS} <= min_turns <= max_turns "
            f"({MIN_TURNS} turns hold one decision and one action item)"
        )
    rng = random.Random(seed)
    # One seed per meeting, so the first k meetings do not depend on n.
    return [_plan_meeting(random.Random(rng.getrandbits(64)), min_turns, max_turns) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Rendering: wording, fillers, digressions
# ---------------------------------------------------------------------------------------------

# How things are said. In a line, {F} is an optional filler opening the turn and {f} an optional
# one between two words; " / " separates the turns of an exchange.
_PHRASEBOOK = """
[opening]
Okay, let's get started. This is our {topic} meeting, and today we{f}need to decide on {subjects}.
Right, welcome to the {topic} meeting, everyone. On the agenda we have {subjects}.
{F}shall we start? This is the {topic} meeting, and I'd like us to{f}settle {subjects} today.
[greeting]
Hi, everyone.
Morning.
{F}hi, sorry I'm a bit late.
[proposal]
{F}for {subject}, I think we should {phrase}.
{F}I'd{f}suggest that we {phrase}. That's what the research points to.
{F}looking at {subject}, my proposal is to{f}{phrase}.
{F}what if we {phrase}? I think people would{f}really like that.
[support]
{F}I like the idea of {thing},{f}that would be {pro}.
{F}I think {thing} could work. It's {pro}.
{F}that makes sense to me. I mean,{f}{thing} would be {pro}.
[pro]
a good selling point
in line with the company image
a good fit for our target group
something our competitors don't have
popular with younger users
[comment]
{F}we should check what that does to the production cost, though.
{F}the survey said that{f}people really care about {subject}.
{F}I'm not totally sure, but{f}let's see how it fits with the rest of the design.
{F}I've seen something like that in the shops, and it looked{f}quite good actually.
{F}how does that work with the, um, the other components?
{F}I can show you some pictures of that later.
{F}we talked about {subject} last time as well, didn't we?
{F}I don't have a strong opinion on {subject}, to be honest.
{F}the younger people in the focus group were{f}quite enthusiastic about that.
{F}does that fit in the budget?
[alternative]
{F}what about {thing} instead? / {F}hmm, I think {thing} would {con}.
{F}couldn't we{f}go for {thing}? / {F}no, {thing} would probably {con}.
{F}I was also thinking of {thing}. / {F}maybe, but{f}{thing} might {con}.
[con]
push the production cost up too much
look a bit old-fashioned
be hard to manufacture
break quite easily
confuse older users
[agreement]
Okay, so that's decided: we'll {phrase}.
Alright, let's {phrase} then. Everyone okay with that?
Good, so we agree to {phrase}.
[chatter]
{F}we also have to keep the production cost under twelve and a half euros.
{F}I was looking at remotes in the shops, and{f}most of them are really boring.
{F}our target group is{f}mostly people between fifteen and thirty-five.
{F}people lose their remotes all the time,{f}that came out of the survey too.
{F}I think the management also wants it to work with, uh, the new TV models.
{F}by the way, the slides from last time are on the shared drive.
[backchannel]
Mm-hmm.
Yeah.
Okay.
Right.
Uh-huh.
Yeah, yeah.
Mm.
[digression]
{F}does anyone know what's for lunch today? / {F}I think it's{f}soup again. / Again? Hmm.
{F}it's really pouring outside, isn't it? / {F}yeah, I got completely soaked on the way in. / Mm.
{F}has anyone tried the new coffee machine? / {F}it's broken again, it only does hot water. / Oh no.
{F}sorry, my laptop just crashed. Give me a second. / {F}no worries, take your time. / Mm-hmm.
{F}is the projector working for you? / {F}it keeps{f}switching itself off. / Typical.
[back to work]
Okay, anyway, let's get back to it.
Right, where were we?
[recap]
{F}so, to recap: we'll {phrases}.
{F}just to sum up,{f}we're going to {phrases}.
[actions intro]
Okay, action items.
So, who does what before next time?
[assignment]
{F}{name}, could you {task} {deadline}?
And {name}, can you{f}{task},{f}{deadline}?
[assignment reply]
{F}sure, I'll do that.
{F}sure, no problem.
Mm-hmm, I can do that.
[volunteer]
{F}I'll {task} {deadline}, if that's okay.
{F}I can{f}{task} {deadline}.
[acknowledgement]
Great, thanks, {name}.
Perfect.
Sounds good.
[closing]
Okay, I think that's everything for today. Thanks, everyone.
Right, that's it. See you all at the next meeting.
{F}great, let's wrap up there. Thanks for coming.
[summary opening]
The Project Manager opened the {topic} meeting.
This was the team's {topic} meeting.
[summary opening with subjects]
In the {topic} meeting, the team discussed {subjects}.
The {topic} meeting covered {subjects}.
The Project Manager opened the {topic} meeting about {subjects}.
[summary decisions]
The team decided to {phrases}.
It was agreed to {phrases}.
The group agreed to {phrases}.
They decided to {phrases}.
"""
LEAD_FILLERS = ("", "", "", "Um, ", "Uh, ", "Yeah, ", "So, ", "Well, ", "You know, ")
MID_FILLERS = (" ", " ", " ", ", um, ", ", uh, ", ", you know, ", ", like, ")
FILLER_SLOT = re.compile(r"\{([Ff])\}")


def template_sections(text: str) -> dict[str, tuple[str, ...]]:
    sections: dict[str, list[str]] = {}
    for line in text.strip().splitlines():
        if line.startswith("["):
            lines = sections.setdefault(line.strip("[]"), [])
        else:
            lines.append(line)
    return {name: tuple(lines) for name, lines in sections.items()}


SAY = template_sections(_PHRASEBOOK)

# Kinds of turns that fill a meeting beyond its facts, and how often each is drawn.
_EXTRAS = ("comment", "alternative", "backchannel", "chatter", "digression", "greeting", "recap", "intro")
_EXTRA_WEIGHTS = (4, 2, 2, 2, 1, 1, 1, 1)
_ACTION_STYLES = (  # (opening, one item, separator)
    ("Action items: ", "the {role} ({name}) will {task} {deadline}", "; "),
    ("Next steps: ", "{name}, the {role}, is to {task} {deadline}", "; "),
    ("", "{name} ({role}) will {task} {deadline}", ". "),
)

Turn = tuple[str | None, str]  # (role, or None for any speaker; text)
_Unit = list[Turn]  # turns that stay together, e.g. an alternative raised and turned down


def fill_template(rng: random.Random, template: str, **facts: str) -> str:
    def filler(match: re.Match[str]) -> str:
        return rng.choice(LEAD_FILLERS if match.group(1) == "F" else MID_FILLERS)

    text = FILLER_SLOT.sub(filler, template).format(**facts).replace(",,", ",")
    return text[0].upper() + text[1:]


def say_line(rng: random.Random, section: str, **facts: str) -> str:
    return fill_template(rng, rng.choice(SAY[section]), **facts)


def join_words(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def decision_units(option: Option, rng: random.Random) -> list[_Unit]:
    proposer = rng.choice(ROLES[1:])
    agreer = PROJECT_MANAGER if rng.random() < 0.7 else rng.choice([r for r in ROLES if r != proposer])
    pro = rng.choice(SAY["pro"])
    return [
        [(proposer, say_line(rng, "proposal", subject=option.subject, phrase=option.phrase))],
        [(None, say_line(rng, "support", thing=option.thing, pro=pro))],
        [(agreer, say_line(rng, "agreement", phrase=option.phrase))],
    ]


def action_turns(item: ActionItem, rng: random.Random) -> list[Turn]:
    facts = {"name": item.name, "task": item.task, "deadline": item.deadline}
    if item.role != PROJECT_MANAGER and rng.random() < 0.6:
        return [
            (PROJECT_MANAGER, say_line(rng, "assignment", **facts)),
            (item.role, say_line(rng, "assignment reply")),
        ]
    acknowledger = PROJECT_MANAGER if item.role != PROJECT_MANAGER else rng.choice(ROLES[1:])
    return [
        (item.role, say_line(rng, "volunteer", **facts)),
        (acknowledger, say_line(rng, "acknowledgement", **facts)),
    ]


def _backchannel_position(block: list[_Unit], rng: random.Random) -> int:
    """A place between proposal and agreement where a back-channel does not touch another one."""
    backchannels = set(SAY["backchannel"])
    free = [i for i in range(1, len(block)) if not backchannels & {block[i - 1][-1][1], block[i][0][1]}]
    return rng.choice(free) if free else rng.randint(1, len(block) - 1)


def _assign_speakers(turns: list[Turn], rng: random.Random) -> list[str]:
    """Give open turns a speaker other than their neighbours, then make sure all four roles speak."""
    speakers: list[str] = []
    for i, (role, _) in enumerate(turns):
        if role is None:
            upcoming = turns[i + 1][0] if i + 1 < len(turns) else None
            role = rng.choice([r for r in ROLES if r not in (*speakers[-1:], upcoming)])
        speakers.append(role)
    open_turns = [i for i, (role, _) in enumerate(turns) if role is None]
    for role in ROLES:
        if role in speakers:
            continue
        candidates = [
            i for i in open_turns if speakers.count(speakers[i]) > 1 and role not in speakers[max(i - 1, 0) : i + 2]
        ]
        if candidates:
            speakers[rng.choice(candidates)] = role
    return speakers


def _render_transcript(plan: MeetingPlan, rng: random.Random) -> tuple[str, list[Option]]:
    """The transcript, and the rejected alternatives it brings up."""
    subjects = join_words([option.subject for option in plan.decisions])
    opening: list[Turn] = [(PROJECT_MANAGER, say_line(rng, "opening", topic=plan.topic, subjects=subjects))]
    decision_blocks = [decision_units(option, rng) for option in plan.decisions]
    middle = list(decision_blocks)  # the decision blocks, with chatter and digressions between them
    actions = [turn for item in plan.action_items for turn in action_turns(item, rng)]
    greeting: list[Turn] = []
    recap: list[Turn] = []
    used: set[str] = set()  # comments, chatter and digressions are said once per meeting
    raised: set[int] = set()  # decisions whose rejected alternative came up
    n_digressions, has_intro = 0, False

    def unused(section: str) -> list[str]:
        return [line for line in SAY[section] if line not in used]

    # Fill the turns the facts leave over with discussion, small talk and back-channels.
    n_left = plan.n_turns - _core_turns(len(plan.decisions), len(plan.action_items))
    while n_left > 0:
        # The first alternative comes up whenever there is room: "also discussed, but rejected".
        first_alternative = not raised and n_left >= 2
        kind = "alternative" if first_alternative else rng.choices(_EXTRAS, weights=_EXTRA_WEIGHTS)[0]
        index = rng.randrange(len(plan.decisions))
        block, option = decision_blocks[index], plan.decisions[index]
        if kind == "comment" and unused("comment"):
            used.add(template := rng.choice(unused("comment")))
            block.insert(rng.randint(1, len(block) - 1), [(None, fill_template(rng, template, subject=option.subject))])
        elif kind == "alternative" and n_left >= 2 and index not in raised:
            raised.add(index)
            facts = {"thing": plan.rejected[index].thing, "con": rng.choice(SAY["con"])}
            position = rng.randint(1, len(block) - 1)
            exchange = rng.choice(SAY["alternative"]).split(" / ")
            block.insert(position, [(None, fill_template(rng, line, **facts)) for line in exchange])
        elif kind == "backchannel":
            block.insert(_backchannel_position(block, rng), [(None, rng.choice(SAY["backchannel"]))])
        elif kind == "chatter" and unused("chatter"):
            used.add(template := rng.choice(unused("chatter")))
            middle.insert(rng.randint(0, len(middle)), [[(None, fill_template(rng, template))]])
        elif kind == "digression" and n_left >= 2 and n_digressions < 2:
            used.add(template := rng.choice(unused("digression")))
            n_digressions += 1
            lines = template.split(" / ")[: min(n_left, rng.randint(2, 3))]
            small_talk: _Unit = [(None, fill_template(rng, line)) for line in lines]
            if n_left > len(small_talk) and rng.random() < 0.5:
                small_talk.append((PROJECT_MANAGER, say_line(rng, "back to work")))
            middle.insert(rng.randint(0, len(middle)), [small_talk])
        elif kind == "greeting" and not greeting:
            greeting.append((None, say_line(rng, "greeting")))
        elif kind == "recap" and not recap:
            phrases = join_words([option.phrase for option in plan.decisions])
            recap.append((PROJECT_MANAGER, say_line(rng, "recap", phrases=phrases)))
        elif kind == "intro" and not has_intro:
            has_intro = True
            actions.insert(0, (PROJECT_MANAGER, say_line(rng, "actions intro")))
        n_middle = sum(len(unit) for block in middle for unit in block)
        n_left = plan.n_turns - sum(map(len, [opening, greeting, recap, actions])) - n_middle - 1

    closing: list[Turn] = [(PROJECT_MANAGER, say_line(rng, "closing"))]
    discussion = [turn for block in middle for unit in block for turn in unit]
    turns = opening + greeting + discussion + recap + actions + closing
    names = dict(plan.participants)
    speakers = _assign_speakers(turns, rng)
    lines = [f"{role} ({names[role]}): {text}" for role, (_, text) in zip(speakers, turns, strict=True)]
    return "\n".join(lines), [plan.rejected[i] for i in sorted(raised)]


def _render_summary(plan: MeetingPlan, raised: list[Option], rng: random.Random) -> str:
    n_facts = len(plan.decisions) + len(plan.action_items)
    subjects = join_words([option.subject for option in plan.decisions])
    section = "summary opening with subjects" if n_facts <= 4 else "summary opening"
    sentences = [
        rng.choice(SAY[section]).format(topic=plan.topic, subjects=subjects),
        rng.choice(SAY["summary decisions"]).format(phrases=join_words([o.phrase for o in plan.decisions])),
    ]
    if raised and n_facts <= 3:  # only where it keeps the summary short
        rejected = "that idea was" if len(raised) == 1 else "those ideas were"
        sentences.append(f"They also discussed {join_words([o.thing for o in raised])}, but {rejected} turned down.")
    opening, item, separator = rng.choice(_ACTION_STYLES)
    sentences.append(opening + separator.join(item.format(**vars(i)) for i in plan.action_items) + ".")
    return " ".join(sentences)


def decision_fact(option: Option) -> Fact:
    """A decision is stated by its verb phrase, as the summaries word it ("use a rubber case")."""
    return Fact("decision", f"The team decided to {option.phrase}.", ((option.phrase,),))


def action_fact(item: ActionItem, deadline_forms: tuple[str, ...] | None = None) -> Fact:
    """An action item is stated by its owner's name, the task and the deadline (in any of ``deadline_forms``)."""
    forms = deadline_forms or (item.deadline,)
    text = f"{item.name} ({item.role}) will {item.task} {'by ' if deadline_forms else ''}{forms[0]}."
    return Fact("action", text, ((item.name,), (item.task,), forms))


def render_meeting(plan: MeetingPlan) -> Meeting:
    """Word a planned meeting: a transcript of exactly ``plan.n_turns`` turns, its summary and its facts."""
    rng = random.Random(plan.render_seed)
    transcript, raised = _render_transcript(plan, rng)
    facts = tuple(map(decision_fact, plan.decisions)) + tuple(map(action_fact, plan.action_items))
    return Meeting(transcript=transcript, summary=_render_summary(plan, raised, rng), facts=facts)


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def generate_meetings(n: int, seed: int = 0, min_turns: int = 12, max_turns: int = 40) -> list[Meeting]:
    """``n`` meetings of ``min_turns..max_turns`` turns each; the same arguments give the same meetings."""
    return [render_meeting(plan) for plan in plan_meetings(n, seed, min_turns, max_turns)]
