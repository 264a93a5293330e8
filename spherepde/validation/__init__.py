"""The spherepde validation suite: published tests and exact solutions, run by `spherepde validate`."""
