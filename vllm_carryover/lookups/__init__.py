"""Drafts without a model: the suffix lookup (arctic-inference's trees of the request's
own text and of the server's past answers, `suffix`), beside the drafter (`beside`),
reading each request's text in pieces (`texts`); how its proposals become drafts
(`drafts`)."""
