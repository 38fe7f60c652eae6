"""Drafts without a model: prompt lookup (the request's own text) and corpus lookup
(the target's usual continuations)."""
