"""Serving engines' K/V cache formats as kvq layouts (`formats`), and `kvq advise` (`advise`)."""
