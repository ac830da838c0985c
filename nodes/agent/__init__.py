"""The site agent: one per site, in front of its SGLang workers."""
