"""A generated chat corpus whose answers are predictable from the prompt.

Templated tasks (arithmetic, unit conversion, sorting, facts about made-up things, spelling,
counting, ...) with formulaic answers: a tiny model trained for a few CPU minutes learns real
structure from it, so a draft trained against that model can reach high acceptance.
Pure Python and seeded: `python -m pipeline.embedded.corpus --out data/chat.jsonl` rewrites the
shipped file byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NUM_CONVERSATIONS = 600
SEED = 1234

WORDS = (
    "apple river garden window pencil rocket castle forest yellow summer winter planet silver "
    "dragon bottle candle basket butter ladder marble orange pepper rabbit saddle tunnel violin "
    "wallet zipper anchor bridge camera dinner engine farmer guitar hammer island jacket kitten "
    "lemon magnet needle ocean pillow puzzle rainbow shadow spider tiger turtle wagon cloud "
    "stone bread chair table house mouse horse sheep train plane green water light night music "
    "paper money smile storm sugar sweet truck voice whale zebra bird book door fish frog lamp "
    "moon rain ship star tree wind wolf bear cake coin desk duck fire gold hand king leaf milk "
    "nest rose salt snow sock"
).split()
COLORS = "red blue green yellow purple orange silver golden teal white black gray pink brown".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = (
    "January February March April May June July August September October November December"
).split()
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SYLLABLES = "zor vax mel tri quo bal nix ran dor fen kal lum pex sar tov yul gri mob wen zat".split()
# kind of made-up thing -> the countable part it has
KINDS = {
    "planet": "moons",
    "city": "bridges",
    "robot": "arms",
    "dragon": "wings",
    "island": "lighthouses",
    "ship": "sails",
    "castle": "towers",
    "forest": "lakes",
}
# (plural from, singular from, plural to, factor)
UNITS = (
    ("kilometers", "kilometer", "meters", 1000),
    ("meters", "meter", "centimeters", 100),
    ("hours", "hour", "minutes", 60),
    ("minutes", "minute", "seconds", 60),
    ("days", "day", "hours", 24),
    ("weeks", "week", "days", 7),
    ("kilograms", "kilogram", "grams", 1000),
    ("liters", "liter", "milliliters", 1000),
    ("feet", "foot", "inches", 12),
    ("yards", "yard", "feet", 3),
    ("years", "year", "months", 12),
    ("dozens", "dozen", "items", 12),
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly tutor. Explain each answer step by step.",
    "You are a careful assistant that always shows its work.",
    "Answer the user's questions clearly and completely.",
)


def _join(items) -> str:
    return ", ".join(str(i) for i in items)


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    prompt = rng.choice(("What is {a} + {b}?", "Please add {a} and {b}.", "Compute {a} plus {b}.",
                         "Can you tell me the sum of {a} and {b}?")).format(a=a, b=b)
    tens, ones = a // 10 * 10 + b // 10 * 10, a % 10 + b % 10
    answer = (f"Let me add them step by step. The tens: {a // 10 * 10} + {b // 10 * 10} = {tens}. "
              f"The ones: {a % 10} + {b % 10} = {ones}. Together that makes {tens} + {ones} = {a + b}. "
              f"So {a} + {b} = {a + b}.")
    return prompt, answer


def subtraction(rng: random.Random) -> tuple[str, str]:
    b = rng.randint(10, 89)
    a = rng.randint(b + 1, 99)
    prompt = rng.choice(("What is {a} - {b}?", "Subtract {b} from {a}.", "Compute {a} minus {b}.",
                         "What do you get if you take {b} away from {a}?")).format(a=a, b=b)
    mid = a - b // 10 * 10
    answer = (f"Let me subtract in two steps: first the tens, then the ones. "
              f"{a} - {b // 10 * 10} = {mid}, and then {mid} - {b % 10} = {a - b}. "
              f"So {a} - {b} = {a - b}.")
    return prompt, answer


def multiplication(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(11, 99), rng.randint(2, 9)
    prompt = rng.choice(("What is {a} x {b}?", "Multiply {a} by {b}.", "Compute {a} times {b}.",
                         "What is the product of {a} and {b}?")).format(a=a, b=b)
    t, o = a // 10 * 10, a % 10
    answer = (f"To multiply {a} by {b}, I split {a} into {t} and {o}. "
              f"{t} x {b} = {t * b} and {o} x {b} = {o * b}. "
              f"Adding the two parts gives {t * b} + {o * b} = {a * b}. So {a} x {b} = {a * b}.")
    return prompt, answer


def conversion(rng: random.Random) -> tuple[str, str]:
    src, one, dst, f = rng.choice(UNITS)
    n = rng.randint(2, 40)
    prompt = rng.choice(("Convert {n} {src} to {dst}.", "How many {dst} are in {n} {src}?",
                         "What is {n} {src} in {dst}?")).format(n=n, src=src, dst=dst)
    answer = (f"There are {f} {dst} in one {one}. To convert, multiply the number of {src} by {f}: "
              f"{n} x {f} = {n * f}. So {n} {src} is equal to {n * f} {dst}.")
    return prompt, answer


def sort_numbers(rng: random.Random) -> tuple[str, str]:
    nums = rng.sample(range(1, 100), rng.randint(4, 7))
    if rng.random() < 0.5:
        prompt = rng.choice(("Sort these numbers from smallest to largest: {l}.", "Put {l} in ascending order.",
                             "Please sort in ascending order: {l}.")).format(l=_join(nums))
        order, out = "ascending order (from smallest to largest)", sorted(nums)
    else:
        prompt = rng.choice(("Sort these numbers from largest to smallest: {l}.", "Put {l} in descending order.",
                             "Please sort in descending order: {l}.")).format(l=_join(nums))
        order, out = "descending order (from largest to smallest)", sorted(nums, reverse=True)
    answer = (f"Here are the {len(nums)} numbers sorted in {order}: {_join(out)}. "
              f"The smallest number is {min(nums)} and the largest number is {max(nums)}.")
    return prompt, answer


def sort_words(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    prompt = rng.choice(("Sort these words alphabetically: {l}.", "Put these words in alphabetical order: {l}.",
                         "Can you alphabetize {l}?")).format(l=_join(words))
    out = sorted(words)
    answer = (f"Here are the {len(words)} words in alphabetical order: {_join(out)}. "
              f'The first word is "{out[0]}" and the last word is "{out[-1]}".')
    return prompt, answer


def backwards(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(WORDS)
    prompt = rng.choice(('Spell the word "{w}" backwards.', 'What is "{w}" written in reverse?',
                         "Reverse the letters of {w}.")).format(w=w)
    answer = (f'The word "{w}" has {len(w)} letters: {_join(w)}. In reverse order the letters are: '
              f'{_join(w[::-1])}. So "{w}" spelled backwards is "{w[::-1]}".')
    return prompt, answer


def count_range(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(1, 40)
    b = a + rng.randint(3, 11)
    if rng.random() < 0.5:
        prompt = rng.choice(("Count from {a} to {b}.", "Please count from {a} up to {b}.")).format(a=a, b=b)
        answer = f"Sure! Counting from {a} up to {b}: {_join(range(a, b + 1))}. That is {b - a + 1} numbers in total."
    else:
        prompt = rng.choice(("Count down from {b} to {a}.", "Please count backwards from {b} to {a}.")).format(a=a, b=b)
        answer = (f"Sure! Counting down from {b} to {a}: {_join(range(b, a - 1, -1))}. "
                  f"That is {b - a + 1} numbers in total.")
    return prompt, answer


def count_letter(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(WORDS)
    c = rng.choice(w) if rng.random() < 0.8 else rng.choice("aeiou")
    prompt = rng.choice(('How many times does the letter "{c}" appear in "{w}"?',
                         'Count the letter "{c}" in the word "{w}".')).format(c=c, w=w)
    k = w.count(c)
    times = "time" if k == 1 else "times"
    answer = (f'Let me go through "{w}" letter by letter: {_join(w)}. '
              f'The letter "{c}" appears {k} {times}. So the answer is {k}.')
    return prompt, answer


def days_after(rng: random.Random) -> tuple[str, str]:
    names, unit = (DAYS, "days") if rng.random() < 0.5 else (MONTHS, "months")
    i, k = rng.randrange(len(names)), rng.randint(2, 6)
    start = names[i]
    steps = [names[(i + j) % len(names)] for j in range(1, k + 1)]
    prompt = rng.choice(("What comes {k} {u} after {s}?", "If it is {s} now, what will it be in {k} {u}?")).format(
        k=k, u=unit, s=start)
    answer = (f"Starting from {start} and counting {k} {unit} forward: {_join(steps)}. "
              f"So {k} {unit} after {start} it is {steps[-1]}.")
    return prompt, answer


def capitals(rng: random.Random) -> tuple[str, str]:
    phrase = " ".join(rng.sample(WORDS, rng.randint(2, 3)))
    prompt = rng.choice(('Write "{p}" in capital letters.', 'Convert "{p}" to uppercase.')).format(p=phrase)
    n = len(phrase.replace(" ", ""))
    answer = (f'Here is "{phrase}" written in capital letters: "{phrase.upper()}". '
              f"Each of the {n} letters was changed to its uppercase form, and the spaces stay the same.")
    return prompt, answer


def compare(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(10, 1000), 2)
    prompt = rng.choice(("Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?",
                         "Is {a} greater than {b}?")).format(a=a, b=b)
    big, small = max(a, b), min(a, b)
    answer = (f"Comparing the two numbers, {big} is larger than {small}. "
              f"The difference between them is {big} - {small} = {big - small}. So the larger number is {big}.")
    return prompt, answer


def alphabet(rng: random.Random) -> tuple[str, str]:
    i = rng.randint(1, 24)
    prev, cur, nxt = LETTERS[i - 1 : i + 2]
    if rng.random() < 0.5:
        prompt = rng.choice(("What letter comes after {c}?", "Which letter follows {c} in the alphabet?")).format(c=cur)
        answer = (f"In the alphabet, the letters around {cur} are {prev}, {cur}, {nxt}. "
                  f"So the letter that comes right after {cur} is {nxt}. It is letter number {i + 2} of 26.")
    else:
        prompt = rng.choice(("What letter comes before {c}?", "Which letter is just before {c} in the alphabet?")).format(c=cur)
        answer = (f"In the alphabet, the letters around {cur} are {prev}, {cur}, {nxt}. "
                  f"So the letter that comes right before {cur} is {prev}. It is letter number {i} of 26.")
    return prompt, answer


def parity(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(10, 9999)
    prompt = rng.choice(("Is {n} even or odd?", "Tell me whether {n} is odd or even.")).format(n=n)
    kind = "even" if n % 2 == 0 else "odd"
    answer = (f"A number is even if it can be divided by 2 with no remainder. The last digit of {n} is {n % 10}, "
              f"which is {kind}. So {n} is an {kind} number.")
    return prompt, answer


TASKS = (addition, subtraction, multiplication, conversion, sort_numbers, sort_words, backwards,
         count_range, count_letter, days_after, capitals, compare, alphabet, parity)


def _name(rng: random.Random) -> str:
    return "".join(rng.sample(SYLLABLES, rng.randint(2, 3))).capitalize()


def entity_conversation(rng: random.Random) -> list[dict]:
    """Facts stated in the first turn and asked back later: the answer is in the context."""
    kind, part = rng.choice(sorted(KINDS.items()))
    name, color, n = _name(rng), rng.choice(COLORS), rng.randint(2, 12)
    turns = [
        ("user", f"Remember this: the {kind} {name} has {n} {part} and its color is {color}."),
        ("assistant", f"Got it. I will remember that the {kind} {name} has {n} {part} and that its color is {color}. "
                      f"Ask me about {name} whenever you like."),
    ]
    questions = [
        (f"How many {part} does {name} have?",
         f"You told me earlier that the {kind} {name} has {n} {part} and that its color is {color}. "
         f"You asked about the {part}, so the answer is {n}: {name} has {n} {part}."),
        (f"What color is {name}?",
         f"You told me earlier that the {kind} {name} has {n} {part} and that its color is {color}. "
         f"You asked about the color, so the answer is {color}: {name} is {color}."),
        (f"Describe {name} in one sentence.",
         f"Here is one sentence about it: {name} is a {color} {kind} with {n} {part}. "
         f"That is everything you told me about the {kind} {name}."),
    ]
    for q, a in rng.sample(questions, rng.randint(1, 2)):
        turns += [("user", q), ("assistant", a)]
    return [{"role": r, "content": c} for r, c in turns]


def entity_question(rng: random.Random) -> tuple[str, str]:
    kind, part = rng.choice(sorted(KINDS.items()))
    name, color, n = _name(rng), rng.choice(COLORS), rng.randint(2, 12)
    prompt = (f"The {kind} {name} is {color} and has {n} {part}. "
              f"What color is {name}, and how many {part} does it have?")
    answer = (f"Based on what you said, {name} is a {color} {kind}. It has {n} {part}. "
              f"In short: the {kind} {name} is {color} and has {n} {part}.")
    return prompt, answer


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.15:
        messages += entity_conversation(rng)
    else:
        for _ in range(rng.choices((1, 2, 3), weights=(45, 35, 20))[0]):
            prompt, answer = rng.choice(TASKS + (entity_question,))(rng)
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.1:
        messages += [{"role": "user", "content": rng.choice(("Thanks!", "Thank you.", "Great, thanks."))},
                     {"role": "assistant", "content": "You are welcome! I am glad I could help. If you have another "
                                                      "question about numbers, words or units, just ask and I will "
                                                      "explain it step by step."}]
    return {"messages": messages}


def generate(n: int = NUM_CONVERSATIONS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def to_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/chat.jsonl"))
    ap.add_argument("-n", type=int, default=NUM_CONVERSATIONS)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_jsonl(generate(args.n, args.seed)))
    print(f"wrote {args.n} conversations to {args.out}")


if __name__ == "__main__":
    main()
