"""What a run reports: the console and the JSON and JUnit files, the certificate, distinct
deviations, and the difference between two reports."""
