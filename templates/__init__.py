"""Jinja2 templates of the HTML report (shipped inside the wheel as rankaudit.templates)."""
