"""What surgery does with other libraries that change a model's forward (each module says the
releases it was checked on)."""
