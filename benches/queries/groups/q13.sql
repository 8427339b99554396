-- Wide SELECT * top-k.
SELECT *
FROM facts
ORDER BY v DESC, id
LIMIT 100
