"""Open development: experiment records, pre-registered criteria, reports and the live page."""
