-- Wide SELECT * of a few rows.
SELECT *
FROM facts
WHERE k1m = 4242
ORDER BY id
