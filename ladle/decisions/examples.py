"""Request examples for the OpenAPI document (`/docs`); the tests send each one and expect a 200."""

TICKET = "My card was charged twice for the same order and nobody answers my emails!"
DECISION_EXAMPLES = {
    "reference dialect": {"input": TICKET, "questions": [
        {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
         "options": [{"name": "billing"}, {"name": "technical", "description": "bugs and outages"}]},
        {"id": "angry", "type": "yes_no", "question": "Is the customer angry?"},
        {"id": "severity", "type": "score", "question": "How severe is it?", "levels": ["low", "medium", "high"]}]},
    "OpenAI dialect": {"input": TICKET, "questions": [
        {"type": "predicate", "name": "angry", "instructions": "The customer is angry."},
        {"type": "choice", "instructions": "Which team should handle this ticket?",
         "choices": [{"value": "billing"}, {"value": "technical"}]}]},
}
SCORE_EXAMPLES = {"items": {"query": "Is the sky blue? Answer:", "items": [" yes", " no"],
                            "label_token_ids": [[9805], [787]], "apply_softmax": True}}  # " yes", " no" in the default model
SYSTEMONE_EXAMPLES = {"three types": {"state": {"message": TICKET, "channel": "email"}, "questions": {
    "urgent": {"type": "noul", "instructions": "Does this convey urgency?",
               "criteria": {"true": "Explicitly time-sensitive", "false": "No time pressure"}},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "Payments and refunds", "technical": None}},
    "severity": {"type": "score", "instructions": "How severe is it?", "criteria": ["cosmetic", "blocking"]}}}}
