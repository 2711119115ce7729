"""Answer quality against a float32 reference: a fixed corpus and the two measures on it.

Used by tests/runtime/test_default_quality.py (the default dtype at every ISA level must track
float32 at least as well as transformers' bfloat16 does) and by benchmarks/runtime_quality.py dtype (the
figures). The text is public domain (the Gettysburg Address, the opening of the Declaration of
Independence, the Preamble and Article I, Section 1-2 of the US Constitution), so it ships with the
repository and nothing is read from outside it.

- Teacher-forced agreement: feed the text, and at every position compare the next token each model
  ranks first; a model that tracks the reference agrees nearly everywhere.
- Greedy chat answers: the first N greedy tokens of a chat reply to each question, compared whole.
"""

from __future__ import annotations

from collections.abc import Sequence

TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in \
Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so \
dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a \
portion of that field, as a final resting place for those who here gave their lives that that nation \
might live. It is altogether fitting and proper that we should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. \
The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add \
or detract. The world will little note, nor long remember what we say here, but it can never forget what \
they did here. It is for us the living, rather, to be dedicated here to the unfinished work which they \
who fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the great \
task remaining before us -- that from these honored dead we take increased devotion to that cause for \
which they gave the last full measure of devotion -- that we here highly resolve that these dead shall \
not have died in vain -- that this nation, under God, shall have a new birth of freedom -- and that \
government of the people, by the people, for the people, shall not perish from the earth.

When in the Course of human events, it becomes necessary for one people to dissolve the political bands \
which have connected them with another, and to assume among the powers of the earth, the separate and \
equal station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the \
opinions of mankind requires that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed by their \
Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. \
That to secure these rights, Governments are instituted among Men, deriving their just powers from the \
consent of the governed.

We the People of the United States, in Order to form a more perfect Union, establish Justice, insure \
domestic Tranquility, provide for the common defence, promote the general Welfare, and secure the \
Blessings of Liberty to ourselves and our Posterity, do ordain and establish this Constitution for the \
United States of America.

All legislative Powers herein granted shall be vested in a Congress of the United States, which shall \
consist of a Senate and House of Representatives.

The House of Representatives shall be composed of Members chosen every second Year by the People of the \
several States, and the Electors in each State shall have the Qualifications requisite for Electors of \
the most numerous Branch of the State Legislature. No Person shall be a Representative who shall not \
have attained to the Age of twenty five Years, and been seven Years a Citizen of the United States, and \
who shall not, when elected, be an Inhabitant of that State in which he shall be chosen.
"""

QUESTIONS = [
    "What is the capital of France?",
    "What is the largest planet in our solar system?",
    "Who wrote the play Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "How many days are there in a week?",
    "What gas do plants absorb from the air?",
    "What is the chemical symbol for gold?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "What language is spoken in Brazil?",
    "Give me a synonym for happy.",
    "What is the tallest mountain on Earth?",
    "Who painted the Mona Lisa?",
    "What is the freezing point of water in Fahrenheit?",
    "What is the opposite of cold?",
    "How many continents are there?",
]

ANSWER_TOKENS = 24


def agreement(ours: Sequence[int], reference: Sequence[int]) -> float:
    """Share of positions where two sequences of per-position choices are equal."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} vs {len(reference)} positions")
    return sum(a == b for a, b in zip(ours, reference, strict=True)) / max(1, len(reference))


def same_answers(ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> int:
    """How many answers are token for token the reference's."""
    return sum(list(a) == list(b) for a, b in zip(ours, reference, strict=True))
