"""Diagnosis after a rollback: replay triage, leaf attribution, screening ahead."""
