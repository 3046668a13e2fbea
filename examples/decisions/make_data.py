"""Writes the labelled decision sets under this folder (seeded, so the files are reproducible).

  tickets.{fit,heldout}.jsonl   support tickets -> team: billing, technical, sales, account
  reviews.{fit,heldout}.jsonl   product reviews -> "The reviewer would recommend the product." yes/no

Each example is a situation written for its class, wrapped in an opening, a detail and a
closing drawn (seeded) from separate lists, so a situation never appears twice in one
wording. The held-out part holds whole situations, every wording of three per class, so
nothing fitted has seen them, not even reworded: a classifier that memorises a situation's
words gains nothing on it. Each line: {"input": text, "label": option name}. The questions are
tickets.question.json and reviews.question.json, in the reference /v1/decisions shape.

Usage: python examples/decisions/make_data.py
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
HELD_OUT_EVERY = 4  # situations 0, 4, 8 of each class are held out, in every wording

TICKET_SITUATIONS = {
    "billing": [
        "I was charged twice for the March invoice", "the refund you promised has not reached my card",
        "our invoice lists 40 seats but we only have 25", "the VAT number is missing from every receipt",
        "my card was declined although the bank says it is fine", "you billed the annual price instead of monthly",
        "the credit note for the outage never showed up", "I need the invoices re-issued to our new company name",
        "the payment failed and now there is a late fee", "the price went up without any notice to us",
    ],
    "technical": [
        "the export job times out after ten minutes", "the API returns 502 for every request since the update",
        "the dashboard stays blank in Firefox", "webhooks stopped firing yesterday afternoon",
        "the mobile app crashes when I open a report", "search results are missing the newest documents",
        "the CSV import mangles accented characters", "single sign-on loops back to the login page",
        "sync between the two regions is stuck at 80 percent", "the scheduled backups fail with a disk error",
    ],
    "sales": [
        "we want a quote for 300 seats on the enterprise plan", "is there a discount for non-profits?",
        "can we get a demo for our procurement team next week?", "we are comparing you with two other vendors",
        "what would a three-year contract cost us?", "do you offer a pilot before we commit?",
        "our whole department wants to move over from a competitor", "we need volume pricing for our resellers",
        "can someone walk our CTO through the premium tier?", "we would like to add the analytics add-on for all teams",
    ],
    "account": [
        "I cannot reset my password, the email never arrives", "please transfer ownership of the workspace to my colleague",
        "I want to delete my account and all my data", "two-factor codes are no longer accepted after I changed phones",
        "how do I change the email address on my login?", "a former employee still has admin access",
        "our workspace was locked after too many login attempts", "I need to merge two accounts I created by mistake",
        "please update the owner of our organisation profile", "I cannot invite new members to my team",
    ],
}
TICKET_OPENINGS = ["Hi,", "Hello support,", "Good morning,", "Hey team,", "Dear support team,", "Hi there,"]
TICKET_DETAILS = [
    "This started on Monday.", "It is blocking my whole team.", "I already tried the help centre.",
    "Our account id is 48213.", "Please get back to me soon.", "This is the second time I am writing.",
]
TICKET_CLOSINGS = ["Thanks, Dana", "Regards, Omar", "Cheers, Lee", "Best, Priya", "Thank you! Marco", "-- Sam"]

REVIEW_SITUATIONS = {
    "yes": [
        "the battery easily lasts two full days", "setup took five minutes and everything just worked",
        "the build quality feels far above its price", "it replaced two older gadgets on my desk",
        "customer service swapped a faulty cable the same day", "the sound is clear even at full volume",
        "my kids use it daily and it still looks new", "the app is simple and the updates keep improving it",
        "it is quieter than any model I have owned", "the screen is bright enough to read in the sun",
    ],
    "no": [
        "it stopped charging after three weeks", "the instructions were useless and half the screws were missing",
        "it overheats within an hour of use", "the app needs a new account every time I open it",
        "support never answered my three emails", "the colour in the photos is nothing like the real thing",
        "it broke the first time it fell off the sofa", "the fan is so loud I had to move it to another room",
        "it arrived scratched and the box was already opened", "the battery drains overnight even when switched off",
    ],
}
REVIEW_OPENINGS = ["Bought this last month.", "Second purchase from this brand.", "Got it as a gift.",
                   "Used it for a few weeks now.", "Ordered it on a whim.", "Upgraded from the older model."]
REVIEW_DETAILS = ["Delivery was quick.", "The price was fair.", "The packaging was plastic-free.",
                  "It is lighter than I expected.", "It comes in three colours.", "I use it mostly at work."]
REVIEW_CLOSINGS = ["", "Honest opinion, nobody paid me.", "Make of that what you will.", "Just my experience.",
                   "Will update this review later.", "That is all."]

QUESTIONS = {
    "tickets": {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
                "options": [{"name": "billing", "description": "invoices, charges, refunds, payments"},
                            {"name": "technical", "description": "bugs, errors, outages, integrations"},
                            {"name": "sales", "description": "quotes, pricing, demos, new contracts"},
                            {"name": "account", "description": "logins, passwords, members, ownership"}]},
    "reviews": {"id": "recommend", "type": "yes_no", "question": "The reviewer would recommend the product."},
}


def examples(situations: dict[str, list[str]], openings: list[str], details: list[str], closings: list[str],
             per_situation: int, rng: random.Random) -> list[dict[str, str]]:
    out = []
    for label, texts in situations.items():
        for situation in texts:
            wordings = list(itertools.product(openings, details, closings))
            ending = "" if situation.endswith("?") else "."
            for opening, detail, closing in rng.sample(wordings, per_situation):
                # after "Hi," the sentence runs on in lower case ("I" excepted)
                runs_on = opening.endswith(",") and not situation.startswith("I ")
                sentence = (situation[0] if runs_on else situation[0].upper()) + situation[1:] + ending
                out.append({"input": f"{opening} {sentence} {detail} {closing}".strip(), "label": label,
                            "situation": situation})
    return out


def write(name: str, situations: dict[str, list[str]], rows: list[dict[str, str]], rng: random.Random) -> None:
    held_out_situations = {text for texts in situations.values() for i, text in enumerate(texts)
                           if i % HELD_OUT_EVERY == 0}
    rng.shuffle(rows)
    parts = {"fit": [r for r in rows if r["situation"] not in held_out_situations],
             "heldout": [r for r in rows if r["situation"] in held_out_situations]}
    for part, part_rows in parts.items():
        with open(HERE / f"{name}.{part}.jsonl", "w") as f:
            f.writelines(json.dumps({"input": r["input"], "label": r["label"]}, ensure_ascii=False) + "\n"
                         for r in part_rows)
    (HERE / f"{name}.question.json").write_text(json.dumps(QUESTIONS[name], indent=2) + "\n")
    print(f"{name}: {len(parts['fit'])} to fit, {len(parts['heldout'])} held out")


def main() -> None:
    rng = random.Random(0)
    tickets = examples(TICKET_SITUATIONS, TICKET_OPENINGS, TICKET_DETAILS, TICKET_CLOSINGS, 8, rng)
    write("tickets", TICKET_SITUATIONS, tickets, rng)
    reviews = examples(REVIEW_SITUATIONS, REVIEW_OPENINGS, REVIEW_DETAILS, REVIEW_CLOSINGS, 10, rng)
    write("reviews", REVIEW_SITUATIONS, reviews, rng)


if __name__ == "__main__":
    main()
