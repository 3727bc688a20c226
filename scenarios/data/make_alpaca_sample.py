#!/usr/bin/env python3
"""Writes alpaca_sample.json: 320 Alpaca-format records ({"instruction", "input", "output"}),
made up here (original text, small deterministic tasks) for scenarios/alpaca_sft.json.
Run by hand: python3 scenarios/data/make_alpaca_sample.py (no packages needed)."""
import json
import os

STATE = [20261206]


def rand(n):
    """A small LCG, so the file does not depend on Python's random module."""
    STATE[0] = (STATE[0] * 1103515245 + 12345) % (1 << 31)
    return STATE[0] % n


WORDS = ["river", "garden", "window", "market", "lantern", "harbor", "meadow", "pencil", "kettle", "bridge",
         "orchard", "ladder", "compass", "blanket", "violin", "canyon", "pebble", "theatre", "island", "candle"]
OPPOSITES = [("hot", "cold"), ("early", "late"), ("open", "closed"), ("heavy", "light"), ("quiet", "loud"),
             ("narrow", "wide"), ("rough", "smooth"), ("empty", "full"), ("ancient", "modern"), ("sharp", "blunt")]
COLOURS = [("a ripe banana", "yellow"), ("fresh grass", "green"), ("a clear sky at noon", "blue"),
           ("fresh snow", "white"), ("a ripe tomato", "red"), ("coal", "black"), ("a carrot", "orange")]
SENTENCES = ["The train leaves before dawn", "Bright lanterns lit the harbor", "She counted the boats twice",
             "A quiet wind crossed the meadow", "The old bridge creaked under the cart"]
TOPICS = {"the sea": ["The sea was calm and silver under the morning light.",
                      "Waves folded over the rocks and slid back into the sea."],
          "a library": ["The library smelled of paper, dust and patience.",
                        "Rows of books waited quietly for their next reader."],
          "autumn": ["Autumn painted the orchard in copper and gold.",
                     "In autumn the evenings arrive early and stay long."]}


def record(i):
    kind = i % 8
    if kind == 0:
        a, b = rand(90) + 10, rand(90) + 10
        return {"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": f"The sum of {a} and {b} is {a + b}."}
    if kind == 1:
        s = SENTENCES[rand(len(SENTENCES))]
        return {"instruction": "Reverse the order of the words in the sentence.", "input": s,
                "output": " ".join(reversed(s.split())) + "."}
    if kind == 2:
        w, o = OPPOSITES[rand(len(OPPOSITES))]
        return {"instruction": "Give the opposite of the word.", "input": w, "output": f"The opposite of \"{w}\" is \"{o}\"."}
    if kind == 3:
        thing, colour = COLOURS[rand(len(COLOURS))]
        return {"instruction": f"What colour is {thing}?", "input": "", "output": f"{thing[0].upper() + thing[1:]} is {colour}."}
    if kind == 4:
        c = rand(41) - 5
        return {"instruction": "Convert the temperature from Celsius to Fahrenheit.", "input": f"{c} degrees Celsius",
                "output": f"{c} degrees Celsius is {c * 9 / 5 + 32:g} degrees Fahrenheit."}
    if kind == 5:
        xs = [rand(100) for _ in range(4 + rand(3))]
        return {"instruction": "Sort the numbers in ascending order.", "input": ", ".join(map(str, xs)),
                "output": ", ".join(map(str, sorted(xs)))}
    if kind == 6:
        topic = list(TOPICS)[rand(len(TOPICS))]
        return {"instruction": f"Write one sentence about {topic}.", "input": "", "output": TOPICS[topic][rand(2)]}
    w = WORDS[rand(len(WORDS))]
    return {"instruction": "Count the letters in the word.", "input": w, "output": f"\"{w}\" has {len(w)} letters."}


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "alpaca_sample.json")
    with open(out, "w") as f:
        json.dump([record(i) for i in range(320)], f, indent=1, ensure_ascii=False)
        f.write("\n")
