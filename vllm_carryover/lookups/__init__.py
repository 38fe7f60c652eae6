"""Drafts without a model: prompt lookup (the request's own text) and corpus lookup
(the target's usual continuations), or instead of both, suffix lookup (arctic-inference's
trees of the request's text and of past answers)."""
